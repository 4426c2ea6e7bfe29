"""Would a longer calibration have ranked the drafts otherwise? Predictions at several continuation lengths.

    python scripts/calibration_length.py results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v4.db \
        --draft results/plans/qwen2.5-coder-1.5b-tasks-avx2-v3.json --draft results/plans/qwen2.5-coder-1.5b-tasks-avx2-v4.json \
        [--tokens 24 64 128] [--dtype bfloat16] [--out results/calibration_length.jsonl]

The search scores a draft on the full model's greedy continuations of its calibration prompts, ``calibration_tokens``
long (24 by default), while a benchmark turn runs 128 tokens or more. This script takes the study's calibration
prompts and cost model, decodes each prompt with our AR once to the longest length asked, and for each length
simulates every draft file on the continuations cut there and prices the rounds with the study's cost model (no
timing: the prices are the study's). It prints acceptance, tokens per round and predicted decode speedup per draft
and length, and appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.provenance import git_commit, machine_fingerprint
from selfspec.search.costs import CostModel
from selfspec.search.pipeline import replay_study
from selfspec.search.simulate import RoundSimulator


def predictions(lm, prompts: list[list[int]], drafts: list[DraftSpec], costs: CostModel, lengths: list[int]) -> list[dict]:
    """One row per (length, draft): the draft's simulated rounds on AR's continuations cut at that length, priced."""
    cfg = DecodeConfig(max_new_tokens=max(lengths))
    conts = [autoregressive(lm.model, p, cfg, lm.eos_ids).tokens for p in prompts]
    rows = []
    for n in sorted(lengths):
        sim = RoundSimulator(lm.model, prompts, [c[:n] for c in conts], lm.eos_ids)
        for d in drafts:
            counts = sim.simulate(d)
            rows.append({"tokens": n, "draft": d.describe(), "acceptance": counts.acceptance,
                         "tokens_per_round": counts.tokens_per_round,
                         "decode_speedup": costs.predicted_speedup(counts, d), "emitted": counts.tokens})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="the study's storage (.db or .journal)")
    ap.add_argument("--name", help="the study's name (default: the file's stem)")
    ap.add_argument("--draft", action="append", required=True, help="a draft file to predict (repeatable)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[24, 64, 128], help="continuation lengths")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype, as the search ran it")
    ap.add_argument("--out", default="results/calibration_length.jsonl")
    args = ap.parse_args()
    name, saved, costs, lm = replay_study(args.study, args.name, args.dtype)
    drafts = [DraftSpec.load(f) for f in args.draft]
    rows = predictions(lm, saved["key"]["prompts"], drafts, costs, args.tokens)
    print(f"{len(saved['key']['prompts'])} calibration prompts of {name}; prices: the study's cost model "
          f"({costs.machine.get('cpu', '?')}, {costs.machine.get('isa', '?')})")
    for r in rows:
        print(f"{r['tokens']:>4} tokens  {r['decode_speedup']:.2f}x predicted, acceptance {r['acceptance']:.3f}, "
              f"{r['tokens_per_round']:.2f} tokens per round  {r['draft']}")
    record = {"study": args.study, "name": name, "drafts": args.draft, "dtype": args.dtype, "rows": rows,
              "cost_model_machine": costs.machine, "machine": machine_fingerprint(), "commit": git_commit()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
