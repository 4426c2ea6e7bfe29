"""The results record: one JSONL row per (sample, method), read back, summarized.

A ``samples.jsonl`` starts with a header row (``"type": "header"``: provenance,
the resolved config, the methods and a fingerprint of what makes rows
comparable); every following row is one (sample, method, pass) triple carrying the raw
:class:`~selfspec.engine.stats.DecodeStats` counters of its generation
(``counters``). Summaries merge those counters and take every rate from
:meth:`DecodeStats.summary`, the one place rates are derived.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from selfspec.assets.data import Sample
from selfspec.engine.decoding import DecodeConfig, Generation
from selfspec.engine.stats import DecodeStats
from selfspec.kernels.packed import pack_format, pack_label


def output_hash(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def sample_row(sample: Sample, method: str, gen: Generation, texts: list[str], rep: int = 0) -> dict:
    """One results row: the sample, its pass (``rep``), the raw counters of its generation, readable
    rates, the output."""
    s = gen.stats.summary()
    return {
        "type": "sample",
        "sample_id": sample.id,
        "method": method,
        "rep": rep,
        "turns": len(sample.turns),
        "counters": gen.stats.counters(),
        # derived by DecodeStats.summary(), for reading the file; summaries are re-derived from the counters
        **{key: s[key] for key in READABLE},
        "output_sha256": output_hash(gen.tokens),
        "output_text": texts,
        **({"reference": sample.reference} if sample.reference else {}),
    }


READABLE = ("new_tokens", "tokens_per_s", "ttft_s", "tpot_s", "acceptance_rate", "mean_accepted_length")


def stats_of_row(row: dict) -> DecodeStats:
    """The raw counters of a row, also from rows written before rows carried them (``counters``)."""
    if "counters" in row:
        return DecodeStats.from_counters(row["counters"])
    return DecodeStats(  # the older row format: the counters under their earlier names
        method=row["method"], requests=row["turns"], prompt_tokens=row.get("prompt_tokens", 0),
        new_tokens=row["new_tokens"], rounds=row["rounds"], plain_steps=row.get("plain_steps", 0),
        drafted=row["drafted"], accepted=row["accepted"], drafted_per_position=list(row["drafted_per_position"]),
        accepted_per_position=list(row["accepted_per_position"]), draft_time=row.get("draft_time_s", 0.0),
        verify_time=row.get("verify_time_s", 0.0), ttft=row["ttft_s"] * row["turns"], total_time=row["wall_time_s"],
        token_latencies=list(row["token_latencies_s"]), stop_reason=row.get("stop_reason", ""),
        fell_back_at=row.get("fell_back_at"),
    )


def _json_lines(path: Path) -> Iterator[dict]:
    """The whole JSON lines of a results file (a torn last line, killed mid-write, is passed over)."""
    if not path.is_file():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            yield json.loads(line)
        except json.JSONDecodeError:
            continue


def read_jsonl(path: Path) -> tuple[dict | None, list[dict]]:
    """Header and sample rows of a results file."""
    header, rows = None, []
    for row in _json_lines(path):
        if row.get("type") == "header":
            header = header or row
        elif row.get("type") == "sample":
            rows.append(row)
    return header, rows


def baseline_of(header: dict | None) -> str:
    """The method a run's speedups are over: its header's ``baseline`` (runs written before headers named it: our AR)."""
    return (header or {}).get("baseline", "autoregressive")


def skipped_samples(path: Path) -> dict[str, str]:
    """Samples a run skipped (``type: skipped`` rows: a prompt too long for the model, an empty turn), with why."""
    return {row["sample_id"]: row.get("reason", "") for row in _json_lines(path) if row.get("type") == "skipped"}


def repair_torn_tail(path: Path, methods: list[str] | None = None) -> int:
    """Cut off what a write stopped midway (a kill, a full disk) left at the end of ``path``; returns the lines cut.

    A partial last line (no closing newline) always goes. With ``methods``, so do the rows of a last (pass, sample)
    that lacks some of them: a sample's rows are written together, so such rows are the head of a torn write, and
    the sample is decoded (and all its rows written) again on resume; kept, they would be there twice.
    """
    if not path.is_file() or path.stat().st_size == 0:
        return 0
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # the end of the last whole line
    cut = int(end < len(data))
    if methods:
        lines = data[:end].splitlines(keepends=True)
        group, start, seen = None, end, set()
        for line in reversed(lines):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                break
            if row.get("type") != "sample" or group not in (None, row_key(row)):
                break
            group, start = row_key(row), start - len(line)
            seen.add(row.get("method"))
            if set(methods) <= seen:  # the last sample is whole: nothing more to cut
                start = end
                break
        if start < end:
            cut += data[start:end].count(b"\n")
            end = start
    if end < len(data):
        with open(path, "rb+") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return cut


def decode_record(cfg: DecodeConfig) -> dict:
    """The decoding settings as a run's fingerprint records them.

    ``packed_weights`` and ``packed_only`` appear only when on, so runs recorded
    before they existed still resume: those made on the weights as loaded with
    ``decoding.packed_weights=false``, those with packed copies as they are. On a CPU
    that cannot pack bf16 weights (:func:`~selfspec.kernels.packed.pack_format`) the
    packing is recorded as it ran: ``packed_weights: fp16`` / ``fp32`` for the copies (``fp16 panels r1`` where our
    fp16 kernel computed them, :func:`~selfspec.kernels.packed.pack_label`), absent
    with no oneDNN (the weights as loaded). Likewise ``rows``
    appears only when not 1, ``row_invariant`` only when off, ``gate`` and ``gate_probe``
    only with the gate on, ``attention`` only when not ``sdpa`` (runs before it attended so).
    """
    rec = asdict(cfg)
    fmt = pack_format()
    if fmt is None:  # asked for, but this CPU runs the weights as loaded: recorded as it ran
        rec["packed_weights"] = rec["packed_only"] = False
    elif fmt in ("fp16", "fp32", "amx") and rec["packed_weights"]:
        rec["packed_weights"] = pack_label()
    for key in ("packed_weights", "packed_only", "gate"):
        if not rec[key]:
            del rec[key]
    if rec["row_invariant"]:
        del rec["row_invariant"]
    if not cfg.gate:
        del rec["gate_probe"]
    if rec["attention"] == "sdpa":
        del rec["attention"]
    if rec["rows"] == 1:
        del rec["rows"]
    return rec


def row_key(row: dict) -> tuple[str, int]:
    """What pairs rows of two methods: the sample and the pass (rows written before passes existed: 0)."""
    return row["sample_id"], row.get("rep", 0)


def summarize(rows: list[dict], baseline: str) -> dict[str, dict]:
    """Per method: the rows' counters merged, every rate from :meth:`DecodeStats.summary`, and
    the share of (sample, pass) pairs whose output equals the baseline's; speedup = tokens/s over
    the baseline's.

    With several passes (``rep``): ``speedup_reps`` holds each pass's speedup (on the samples
    both methods decoded in it) and ``drift`` the method's own tokens/s in its last pass over
    its first, on the samples both passes hold (1.0 = no drift; NaN with one pass).
    """
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    base_hash = {row_key(r): r["output_sha256"] for r in by.get(baseline, [])}
    out = {}
    for name, rs in by.items():
        s = DecodeStats.merged([stats_of_row(r) for r in rs]).summary()
        matched = [r["output_sha256"] == base_hash[row_key(r)] for r in rs if row_key(r) in base_hash]
        out[name] = {
            "samples": len({r["sample_id"] for r in rs}),
            "reps": len({r.get("rep", 0) for r in rs}),
            **{key: s[key] for key in SUMMARY_KEYS},
            "wall_time_s": s["total_time_s"],
            "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in rs),
            "greedy_match": sum(matched) / len(matched) if matched else float("nan"),
            "drift": _drift(rs),
        }
    base = out.get(baseline)
    for name, s in out.items():
        s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        lo, hi = paired_bootstrap(by[name], by.get(baseline, []))
        s["speedup_ci95"] = [lo, hi]
        s["speedup_reps"] = _pass_speedups(by[name], by.get(baseline, []))
    return out


def _tokens_per_s(rows: list[dict]) -> float:
    return DecodeStats.merged([stats_of_row(r) for r in rows]).summary()["tokens_per_s"]


def _by_pass(rows: list[dict]) -> dict[int, dict[str, dict]]:
    out: dict[int, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(r.get("rep", 0), {})[r["sample_id"]] = r
    return out


def _drift(rows: list[dict]) -> float:
    """Tokens/s of the last pass over the first, on the samples both hold (NaN with one pass)."""
    passes = _by_pass(rows)
    if len(passes) < 2:
        return float("nan")
    first, last = passes[min(passes)], passes[max(passes)]
    common = sorted(set(first) & set(last))
    if not common:
        return float("nan")
    return _tokens_per_s([last[i] for i in common]) / _tokens_per_s([first[i] for i in common])


def _pass_speedups(rows: list[dict], base_rows: list[dict]) -> list[float]:
    """Each pass's speedup of ``rows`` over ``base_rows``, on the samples both decoded in that pass."""
    mine, theirs = _by_pass(rows), _by_pass(base_rows)
    out = []
    for rep in sorted(set(mine) & set(theirs)):
        common = sorted(set(mine[rep]) & set(theirs[rep]))
        if common:
            out.append(_tokens_per_s([mine[rep][i] for i in common]) / _tokens_per_s([theirs[rep][i] for i in common]))
    return out


def paired_bootstrap(rows: list[dict], base_rows: list[dict], n: int = 2000, seed: int = 0,
                     decode: bool = False) -> tuple[float, float]:
    """95% interval of the speedup of ``rows`` over ``base_rows``, paired by sample (percentile bootstrap).

    Each resample draws the run's samples with replacement and takes total tokens over total
    time of both methods on the same draw, as the speedup itself is taken; a sample decoded in
    several passes counts with all of them (its tokens and times summed). The interval covers
    the prompts' spread; the passes' own spread is in ``speedup_reps``. NaN with fewer than two
    paired samples. ``decode``: the tokens after each request's first over the time after it (the
    prefill left out, :func:`paired_totals`).
    """
    return paired_speedup(rows, base_rows, n, seed, decode)[1:]


def paired_speedup(rows: list[dict], base_rows: list[dict], n: int = 2000, seed: int = 0,
                   decode: bool = False) -> tuple[float | None, float, float]:
    """The speedup of ``rows`` over ``base_rows`` on the samples both decoded (each one's total tokens over its total
    time) and its 95% interval (:func:`paired_bootstrap`); None for the speedup where no sample was decoded by both."""
    mine, theirs = paired_totals(rows, decode), paired_totals(base_rows, decode)
    ids = sorted(set(mine) & set(theirs))
    if not ids:
        return None, float("nan"), float("nan")
    pairs = torch.tensor([mine[i] + theirs[i] for i in ids], dtype=torch.float64)
    tokens, seconds, base_tokens, base_seconds = pairs.sum(dim=0).tolist()
    lo, hi = ratio_interval(pairs, n, seed) if len(ids) >= 2 else (float("nan"), float("nan"))
    return (tokens / seconds) / (base_tokens / base_seconds), lo, hi


def paired_totals(rows: list[dict], decode: bool = False) -> dict[str, list[float]]:
    """Per sample id, ``[tokens, seconds]`` over its rows: every new token over the whole time, or with ``decode``
    the tokens after each request's first over the time after it (what a draft changes; a long prompt's prefill
    is the same for every method and dilutes the end-to-end ratio)."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        st = stats_of_row(r)
        t = acc.setdefault(r["sample_id"], [0.0, 0.0])
        t[0] += st.new_tokens - (st.requests if decode else 0)
        t[1] += st.total_time - (st.ttft if decode else 0.0)
    return acc


def ratio_interval(pairs: torch.Tensor, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of ``(sum a / sum b) / (sum c / sum d)`` over the rows ``(a, b, c, d)`` of
    ``pairs`` ``[samples, 4]``, each resample drawing whole rows with replacement (a paired comparison: a, b one
    method's tokens and seconds on a sample, c, d the other's)."""
    g = torch.Generator().manual_seed(seed)
    draw = pairs[torch.randint(len(pairs), (n, len(pairs)), generator=g)].sum(dim=1)  # n x 4 totals
    ratio = (draw[:, 0] / draw[:, 1]) / (draw[:, 2] / draw[:, 3])
    lo, hi = torch.quantile(ratio, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


def seconds_ratio(base: list[float], other: list[float]) -> tuple[float, float, float]:
    """``other``'s seconds over ``base``'s, summed over repetitions timed in pairs (``base[i]`` beside
    ``other[i]``), and its 95% paired-bootstrap interval (:func:`ratio_interval`): ``(ratio, lo, hi)``."""
    a, b = (torch.tensor(v, dtype=torch.float64) for v in (base, other))
    ones = torch.ones_like(a)
    lo, hi = ratio_interval(torch.stack([ones, a, ones, b], dim=1))
    return float(b.sum() / a.sum()), lo, hi


SUMMARY_KEYS = ("new_tokens", "tokens_per_s", "acceptance_rate", "mean_accepted_length", "acceptance_by_position",
                "ttft_s", "tpot_s", "latency_p50_s", "latency_p99_s", "drafted", "accepted", "rounds")
