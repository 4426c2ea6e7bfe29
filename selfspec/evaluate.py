"""Evaluation: decode every sample of a task set with several methods, one JSONL row each.

The file starts with a header row (``"type": "header"``: provenance, the
resolved config, the methods and a fingerprint of what makes rows
comparable); every following row is one (sample, method) pair. All methods
run in the same process on the same prompts, after a warm-up; within a
sample the method order rotates so no method always runs first.

Resume: rerunning into an existing file checks the fingerprint, skips
samples whose rows are all present and appends the rest. A sample's rows are
written together once all its methods are done, so a kill loses at most the
sample in progress.
"""

from __future__ import annotations

import hashlib
import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from tqdm.auto import tqdm

from .data import Sample, TaskSet
from .decoding import DecodeConfig, Generation
from .errors import SelfSpecError
from .methods import Method
from .models import LoadedModel, encode_chat
from .stats import DecodeStats, percentile


@dataclass(frozen=True)
class EvalSettings:
    out_path: Path
    baseline: str = "autoregressive"
    n_samples: int | None = None  # first n eval samples; None = all
    warmup_tokens: int = 16


def output_hash(tokens: list[int]) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


def run_sample(method: Method, lm: LoadedModel, sample: Sample) -> tuple[Generation, list[str]]:
    """Decode all turns of ``sample``; later turns follow the method's own earlier answers."""
    messages: list[dict] = []
    gens: list[Generation] = []
    texts: list[str] = []
    tokens: list[int] = []
    for turn in sample.turns:
        messages.append({"role": "user", "content": turn})
        gen = method.generate(encode_chat(lm.tokenizer, messages))
        text = lm.tokenizer.decode([t for t in gen.tokens if t not in lm.eos_ids], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        gens.append(gen)
        texts.append(text)
        tokens.extend(gen.tokens)
    return Generation(tokens, DecodeStats.merged([g.stats for g in gens])), texts


def sample_row(sample: Sample, method: Method, gen: Generation, texts: list[str]) -> dict:
    s = gen.stats.summary()
    return {
        "type": "sample",
        "sample_id": sample.id,
        "method": method.name,
        "turns": len(sample.turns),
        "prompt_tokens": s["prompt_tokens"],
        "new_tokens": s["new_tokens"],
        "wall_time_s": s["total_time_s"],
        "tokens_per_s": s["tokens_per_s"],
        "ttft_s": s["ttft_s"],
        "tpot_s": s["tpot_s"],
        "latency_p50_s": s["latency_p50_s"],
        "latency_p99_s": s["latency_p99_s"],
        "token_latencies_s": [round(x, 6) for x in gen.stats.token_latencies],
        "rounds": s["rounds"],
        "plain_steps": s["plain_steps"],
        "drafted": s["drafted"],
        "accepted": s["accepted"],
        "drafted_per_position": gen.stats.drafted_per_position,
        "accepted_per_position": gen.stats.accepted_per_position,
        "draft_time_s": s["draft_time_s"],
        "verify_time_s": s["verify_time_s"],
        "stop_reason": s["stop_reason"],
        "fell_back_at": s["fell_back_at"],
        "output_sha256": output_hash(gen.tokens),
        "output_text": texts,
    }


def read_jsonl(path: Path) -> tuple[dict | None, list[dict]]:
    """Header and rows of a results file; a torn last line (killed mid-write) is dropped."""
    header, rows = None, []
    if not path.is_file():
        return None, []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("type") == "header":
            header = header or row
        elif row.get("type") == "sample":
            rows.append(row)
    return header, rows


def decode_record(cfg: DecodeConfig) -> dict:
    """The decoding settings as a run's fingerprint records them.

    ``packed_weights`` and ``packed_only`` appear only when on, so runs recorded
    before they existed still resume: those made on the weights as loaded with
    ``decoding.packed_weights=false``, those with packed copies as they are.
    """
    rec = asdict(cfg)
    for key in ("packed_weights", "packed_only"):
        if not rec[key]:
            del rec[key]
    return rec


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def evaluate(lm: LoadedModel, tasks: TaskSet, methods: list[Method], settings: EvalSettings, header: dict,
             on_sample: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Run every method on every eval sample (resuming a partial file); returns all rows."""
    if not methods:
        raise SelfSpecError("no methods to evaluate")
    names = [m.name for m in methods]
    if settings.baseline not in names:
        raise SelfSpecError(f"the baseline {settings.baseline!r} is not among the methods {names}")
    samples = list(tasks.eval[: settings.n_samples])
    if not samples:
        raise SelfSpecError(f"dataset {tasks.name!r} has no eval samples")
    fingerprint = {
        "model": lm.name, "dtype": lm.info.get("dtype"), "dataset": tasks.name,
        "max_new_tokens": methods[0].cfg.max_new_tokens, "methods": names,
        "decode": {m.name: decode_record(m.cfg) for m in methods},
        "plans": {m.name: {"num_layers": m.plan.num_layers, "attn": m.plan.attn, "mlp": m.plan.mlp}
                  for m in methods if m.plan is not None},
        "method_info": {m.name: m.info for m in methods if m.info},
    }
    fingerprint = json.loads(json.dumps(fingerprint))  # the form it has when read back
    path = settings.out_path
    old_header, rows = read_jsonl(path)
    if old_header is not None and old_header.get("fingerprint") != fingerprint:
        raise SelfSpecError(
            f"{path} holds results of another setting (model, dataset, methods, decoding or plan differ); "
            "choose another output folder or delete the file to start over"
        )
    done: dict[str, set[str]] = {}
    for r in rows:
        done.setdefault(r["sample_id"], set()).add(r["method"])
    todo = [s for s in samples if not set(names) <= done.get(s.id, set())]
    path.parent.mkdir(parents=True, exist_ok=True)
    if old_header is None:
        head = {"type": "header", "fingerprint": fingerprint, "baseline": settings.baseline,
                "extra_memory_bytes": {m.name: m.extra_memory_bytes for m in methods}, **header}
        path.write_text(json.dumps(head) + "\n", encoding="utf-8")
    elif todo:
        print(f"resuming {path}: {len(samples) - len(todo)} of {len(samples)} samples already done", file=sys.stderr)
    if todo:
        warm = todo[0]
        for m in methods:  # warm-up: first calls pay for allocation and kernel selection
            m.generate(encode_chat(lm.tokenizer, [{"role": "user", "content": warm.turns[0]}]),
                       max_new_tokens=min(settings.warmup_tokens, m.cfg.max_new_tokens))
    bar = tqdm(todo, desc=f"{lm.name} / {tasks.name}", unit="sample", file=sys.stderr)
    for i, sample in enumerate(bar):
        order = methods[i % len(methods):] + methods[: i % len(methods)]
        new_rows = []
        for m in order:
            gen, texts = run_sample(m, lm, sample)
            new_rows.append(sample_row(sample, m, gen, texts))
        new_rows.sort(key=lambda r: names.index(r["method"]))
        for r in new_rows:
            r["peak_rss_bytes"] = _peak_rss_bytes()
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in new_rows))
        rows.extend(new_rows)
        bar.set_postfix({r["method"][:12]: f"{r['tokens_per_s']:.1f}t/s" for r in new_rows})
        if on_sample:
            on_sample(new_rows)
    return [r for r in rows if r["sample_id"] in {s.id for s in samples}]


def summarize(rows: list[dict], baseline: str) -> dict[str, dict]:
    """Per-method totals and rates over rows; speedup = tokens/time of the method over the baseline's."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r)
    base_hash = {r["sample_id"]: r["output_sha256"] for r in by.get(baseline, [])}
    out = {}
    for name, rs in by.items():
        tokens = sum(r["new_tokens"] for r in rs)
        time_s = sum(r["wall_time_s"] for r in rs)
        drafted, accepted, rounds = (sum(r[k] for r in rs) for k in ("drafted", "accepted", "rounds"))
        lat = [x for r in rs for x in r["token_latencies_s"]]
        width = max((len(r["drafted_per_position"]) for r in rs), default=0)
        d_pos = [sum(r["drafted_per_position"][i] for r in rs if i < len(r["drafted_per_position"])) for i in range(width)]
        a_pos = [sum(r["accepted_per_position"][i] for r in rs if i < len(r["accepted_per_position"])) for i in range(width)]
        matched = [r["output_sha256"] == base_hash[r["sample_id"]] for r in rs if r["sample_id"] in base_hash]
        out[name] = {
            "samples": len(rs),
            "new_tokens": tokens,
            "wall_time_s": time_s,
            "tokens_per_s": tokens / time_s if time_s > 0 else float("nan"),
            "acceptance_rate": accepted / drafted if drafted else float("nan"),
            "mean_accepted_length": 1.0 + accepted / rounds if rounds else float("nan"),
            "acceptance_by_position": [a / d if d else float("nan") for a, d in zip(a_pos, d_pos)],
            "ttft_s": sum(r["ttft_s"] for r in rs) / len(rs),
            "tpot_s": _nanmean([r["tpot_s"] for r in rs]),
            "latency_p50_s": percentile(lat, 0.5),
            "latency_p99_s": percentile(lat, 0.99),
            "peak_rss_bytes": max(r.get("peak_rss_bytes", 0) for r in rs),
            "greedy_match": sum(matched) / len(matched) if matched else float("nan"),
        }
    base = out.get(baseline)
    for s in out.values():
        s["speedup"] = s["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
    return out


def _nanmean(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return sum(xs) / len(xs) if xs else float("nan")

