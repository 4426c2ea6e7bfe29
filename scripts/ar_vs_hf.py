"""Our autoregressive loop against transformers' ``generate``, step by step.

    python scripts/ar_vs_hf.py --model qwen2.5-coder-1.5b --reps 3 --max-new-tokens 64

All methods come from the evaluation harness (``build_method``), decode the same
*calibration* prompts (never eval rows) after a warm-up, alternating which goes first.
Printed and appended as one JSON line to --out: total tokens/s of each, the median
per-token latency, and with --profile the operators where each
spends its CPU time (torch.profiler over one run each).
"""

from __future__ import annotations

import argparse
import json

import torch

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.harness import interleaved
from selfspec.engine.stats import DecodeStats
from selfspec.eval.methods import build_method
from selfspec.provenance import append_row, git_commit

METHODS = ("autoregressive", "hf_generate", "hf_generate_stock")  # generate on our packed kernels, and on stock ones


def top_ops(fn, n: int = 12) -> list[dict]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return [{"op": e.key, "self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count} for e in events]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--datasets", nargs="+", default=["humaneval", "gsm8k"])
    ap.add_argument("--prompts", type=int, default=1, help="calibration prompts per dataset")
    ap.add_argument("--reps", type=int, default=3, help="runs of each method per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="also profile one run of each method")
    ap.add_argument("--out", default="results/ar_vs_hf.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    prompts = calibration_prompts(lm.tokenizer, args.datasets, args.prompts)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens)
    methods = {m: build_method(m, lm, cfg) for m in METHODS}
    per_rep = interleaved({name: m.generate for name, m in methods.items()}, prompts, args.reps, warmup_tokens=8)
    res = {"model": args.model, "datasets": args.datasets, "prompts": len(prompts), "reps": args.reps,
           "max_new_tokens": args.max_new_tokens, "git_commit": git_commit()}
    for name in METHODS:
        s = DecodeStats.merged(per_rep[name]).summary()
        res[name] = {"tok_s": round(s["tokens_per_s"], 3), "median_token_latency_ms": round(1e3 * s["latency_p50_s"], 1)}
    for name in METHODS[1:]:
        res[f"{name}_over_ours"] = round(res[name]["tok_s"] / res["autoregressive"]["tok_s"], 3)
    if args.profile:
        for name in METHODS:
            res[name]["top_ops"] = top_ops(lambda name=name: methods[name].generate(prompts[0], 32))
    print(json.dumps(res, indent=1), flush=True)
    append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
