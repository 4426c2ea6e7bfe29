"""The results record: one JSONL row per (sample, method), read back, summarized.

A ``samples.jsonl`` starts with a header row (``"type": "header"``: provenance,
the resolved config, the methods and a fingerprint of what makes rows
comparable); every following row is one (sample, method) pair carrying the raw
:class:`~selfspec.engine.stats.DecodeStats` counters of its generation
(``counters``). Summaries merge those counters and take every rate from
:meth:`DecodeStats.summary`, the one place rates are derived.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import torch

from selfspec.assets.data import Sample
from selfspec.engine.decoding import DecodeConfig, Generation
from selfspec.engine.stats import DecodeStats


def output_hash(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def sample_row(sample: Sample, method: str, gen: Generation, texts: list[str]) -> dict:
    """One results row: the sample, the raw counters of its generation, readable rates, the output."""
    s = gen.stats.summary()
    return {
        "type": "sample",
        "sample_id": sample.id,
        "method": method,
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


def skipped_samples(path: Path) -> dict[str, str]:
    """Samples a run skipped (``type: skipped`` rows: a prompt too long for the model, an empty turn), with why."""
    return {row["sample_id"]: row.get("reason", "") for row in _json_lines(path) if row.get("type") == "skipped"}


def repair_torn_tail(path: Path) -> bool:
    """Cut a partial last line (no closing newline) off ``path``; True when there was one."""
    if not path.is_file() or path.stat().st_size == 0:
        return False
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return False
    with open(path, "rb+") as f:
        f.truncate(data.rfind(b"\n") + 1)
    return True


def decode_record(cfg: DecodeConfig) -> dict:
    """The decoding settings as a run's fingerprint records them.

    ``packed_weights`` and ``packed_only`` appear only when on, so runs recorded
    before they existed still resume: those made on the weights as loaded with
    ``decoding.packed_weights=false``, those with packed copies as they are. Likewise
    ``rows`` appears only when not 1 and ``exact`` only when on.
    """
    rec = asdict(cfg)
    for key in ("packed_weights", "packed_only", "exact"):
        if not rec[key]:
            del rec[key]
    if rec["rows"] == 1:
        del rec["rows"]
    return rec


def summarize(rows: list[dict], baseline: str) -> dict[str, dict]:
    """Per method: the rows' counters merged, every rate from :meth:`DecodeStats.summary`, and
    the share of samples whose output equals the baseline's; speedup = tokens/s over the baseline's."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    base_hash = {r["sample_id"]: r["output_sha256"] for r in by.get(baseline, [])}
    out = {}
    for name, rs in by.items():
        s = DecodeStats.merged([stats_of_row(r) for r in rs]).summary()
        matched = [r["output_sha256"] == base_hash[r["sample_id"]] for r in rs if r["sample_id"] in base_hash]
        out[name] = {
            "samples": len(rs),
            **{key: s[key] for key in SUMMARY_KEYS},
            "wall_time_s": s["total_time_s"],
            "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in rs),
            "greedy_match": sum(matched) / len(matched) if matched else float("nan"),
        }
    base = out.get(baseline)
    for name, s in out.items():
        s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        lo, hi = paired_bootstrap(by[name], by.get(baseline, []))
        s["speedup_ci95"] = [lo, hi]
    return out


def paired_bootstrap(rows: list[dict], base_rows: list[dict], n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the speedup of ``rows`` over ``base_rows``, paired by sample (percentile bootstrap).

    Each resample draws the run's samples with replacement and takes total tokens over total
    time of both methods on the same draw, as the speedup itself is taken. The interval
    covers the prompts' spread; it does not cover drift between runs. NaN with fewer than
    two paired samples.
    """
    mine = {r["sample_id"]: r for r in rows}
    theirs = {r["sample_id"]: r for r in base_rows}
    ids = sorted(set(mine) & set(theirs))
    if len(ids) < 2:
        return float("nan"), float("nan")

    def tokens_time(row: dict) -> list[float]:
        st = stats_of_row(row)
        return [st.new_tokens, st.total_time]

    t = torch.tensor([tokens_time(mine[i]) + tokens_time(theirs[i]) for i in ids], dtype=torch.float64)
    g = torch.Generator().manual_seed(seed)
    draw = t[torch.randint(len(ids), (n, len(ids)), generator=g)].sum(dim=1)  # n x 4 totals
    ratio = (draw[:, 0] / draw[:, 1]) / (draw[:, 2] / draw[:, 3])
    lo, hi = torch.quantile(ratio, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return lo, hi


SUMMARY_KEYS = ("new_tokens", "tokens_per_s", "acceptance_rate", "mean_accepted_length", "acceptance_by_position",
                "ttft_s", "tpot_s", "latency_p50_s", "latency_p99_s", "drafted", "accepted", "rounds")
