"""What a full-depth forward costs as a function of its width (tokens verified at once).

    python scripts/verify_width.py [--model qwen2.5-coder-0.5b] [--widths 1 2 4 8 16 32] [--reps 9] [--kernels stock]

On the packed weights decoding uses (``--kernels stock``: the weights as loaded), after a prefill
of one calibration prompt, times a forward over ``m`` tokens at the end of the context for each width, round-robin (so load
changes hit all widths alike), with a chain mask (the model's own causal mask) and, for
widths >= 3, with a draft tree's mask (a star: every node a child of the first), which is
what a tree verify adds. Prints and appends one JSON line (medians, and the ratio to the
one-token forward) to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.engine.stats import Clock
from selfspec.engine.tree import DraftTree, tree_attention_mask
from selfspec.kernels.packed import kernels_label, packed_weights
from selfspec.provenance import append_row, git_commit, machine_fingerprint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kernels", choices=["packed", "stock"], default="packed",
                    help="the packed weights decoding uses (bf16, or fp16/fp32 copies on an AVX2 CPU), or the weights as loaded")
    ap.add_argument("--out", default="results/verify_width.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    prompt = calibration_prompts(lm.tokenizer, ["humaneval"], 1)[0]
    ctx = torch.tensor(prompt, dtype=torch.long)
    widest = max(args.widths)
    cache = PositionalKVCache(lm.model, max_len=len(prompt) + widest)
    clock = Clock()
    trees = {}
    for m in args.widths:
        if m >= 3:
            tree = DraftTree(0, budget=m)
            tree.add_path([1], "a")
            for t in range(2, m):
                tree.add_path([t], "b", parent=1)
            trees[m] = tree_attention_mask(lm.model, tree, len(prompt), "cpu"), torch.tensor(tree.depth)
    configs = [(str(m), m, None) for m in args.widths] + [(f"{m}/tree", m, "tree") for m in trees]
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}
    with torch.inference_mode(), packed_weights(lm.model, on=args.kernels == "packed"):
        forward_at(lm.model, cache, ctx, 0, keep=1)
        for rep in range(args.reps + 1):
            for name, m, kind in configs:
                tokens = ctx[:m]
                t0 = clock.now()
                if kind:
                    mask, depth = trees[m]
                    forward_at(lm.model, cache, tokens, len(prompt), keep=m, position_ids=len(prompt) + depth,
                               attention_mask=mask)
                else:
                    forward_at(lm.model, cache, tokens, len(prompt), keep=m)
                dt = clock.now() - t0
                if rep:  # repetition 0 is the warm-up
                    times[name].append(dt)
    med = {name: statistics.median(v) for name, v in times.items()}
    one = med[str(min(args.widths))]
    res = {"model": args.model, "kernels": kernels_label(args.kernels == "packed"), "context_tokens": len(prompt),
           "reps": args.reps,
           "median_ms": {k: round(v * 1e3, 2) for k, v in med.items()},
           "over_narrowest": {k: round(v / one, 3) for k, v in med.items()},
           "machine": machine_fingerprint(), "git_commit": git_commit()}
    print(json.dumps(res), flush=True)
    append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
