"""What a draft step costs with each draft head: full or cut, in the model's precision or quantized.

    python scripts/draft_heads.py [--model qwen2.5-coder-1.5b] [--weights int4] [--group-size 128]
                                  [--heads 0 32768] [--head-weights model int8 int4] [--reps 9]

On the packed bf16 weights decoding uses, after a prefill of one calibration prompt, times a
one-token draft forward (every sublayer kept, the kept linears in ``--weights``) with each head
(``--heads`` sizes x ``--head-weights``), and the full model's one-token forward, round-robin
(so load changes hit all alike), medians. Also reports, for each head, how often its argmax over
the next 64 greedy tokens of the full model agrees with the same draft's model-precision full
head (what a quantized head costs in agreement, before any acceptance is measured), the head alone
(one hidden row through each head, same round-robin) and what quantizing the largest cut head's rows
once costs (why a request's own ids are not quantized per request). Prints and appends one JSON line
to --out.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import nullcontext

import torch

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.draft.lowbit import quantize
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import DecodeConfig, autoregressive, forward_at
from selfspec.engine.stats import Clock
from selfspec.kernels.packed import packed_weights
from selfspec.model.plan import SkipPlan
from selfspec.provenance import append_row, git_commit, machine_fingerprint
from selfspec.search.costs import time_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--weights", default="int4", choices=["model", "int8", "int4"])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--heads", type=int, nargs="+", default=[0, 16384, 32768])
    ap.add_argument("--head-weights", nargs="+", default=["model", "int8", "int4"])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default="results/draft_heads.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    prompt = calibration_prompts(lm.tokenizer, ["humaneval"], 1)[0]
    cont = autoregressive(lm.model, prompt, DecodeConfig(max_new_tokens=64), lm.eos_ids).tokens
    ctx = torch.tensor(prompt + cont, dtype=torch.long)
    plan = SkipPlan(lm.model.config.num_hidden_layers)
    paths = {}
    for hw in args.head_weights:
        for n in args.heads:
            opts = DraftOptions(weights=args.weights, group_size=args.group_size, head_tokens=n, head_weights=hw)
            paths[f"{n or 'full'}/{hw}"] = DraftPath(lm.model, plan, opts, stop_ids=lm.eos_ids)
    cache = PositionalKVCache(lm.model, max_len=len(ctx) + 2)
    clock = Clock()
    p = len(prompt)
    times: dict[str, list[float]] = {name: [] for name in ["full model", *paths]}
    agree: dict[str, float] = {}
    with torch.inference_mode(), packed_weights(lm.model):
        forward_at(lm.model, cache, ctx, 0, keep=1)
        ref = None
        for name, path in paths.items():  # agreement: teacher-forced over the continuation, one forward each
            path.prepare(torch.tensor(prompt))
            with path.drafting():
                top = forward_at(lm.model, cache, ctx[p:], p, keep=len(cont)).argmax(-1)
            ref = top if ref is None else ref
            agree[name] = float((top == ref).float().mean())
        forward_at(lm.model, cache, ctx[p:], p, keep=1)  # the full model's keys/values back in place
        for rep in range(args.reps + 1):
            for name in times:
                path = paths.get(name)
                if path is not None:
                    path.prepare(torch.tensor(prompt))
                with path.drafting() if path is not None else nullcontext():
                    t0 = clock.now()
                    forward_at(lm.model, cache, ctx[-1:], len(ctx) - 1, keep=1)
                    dt = clock.now() - t0
                if rep:  # repetition 0 is the warm-up
                    times[name].append(dt)
    head = lm.model.get_output_embeddings()
    x = torch.randn(1, 1, head.weight.shape[1], dtype=head.weight.dtype)
    with torch.inference_mode(), packed_weights(lm.model):
        alone = time_heads(paths, x, args.reps, clock)  # each path keeps the head choice prepared above
        widest = max(args.heads)
        rows = head.weight.detach()[: widest or head.weight.shape[0]].contiguous()
        t0 = clock.now()
        quantize(rows, "int4", args.group_size)
        t_quant = clock.now() - t0
    med = {name: statistics.median(v) for name, v in times.items()}
    row = {"model": args.model, "weights": args.weights, "group_size": args.group_size, "reps": args.reps,
           "context": len(ctx), "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
           "over_full_model": {k: round(v / med["full model"], 3) for k, v in med.items()},
           "argmax_agrees_with_first_head": {k: round(v, 3) for k, v in agree.items()},
           "head_alone_ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in alone.items()},
           "int4_quantize_rows_s": {str(rows.shape[0]): round(t_quant, 3)},
           "machine": machine_fingerprint(), "commit": git_commit()}
    for name, ms in row["ms"].items():
        print(f"{name:16s} {ms:8.2f} ms  {row['over_full_model'][name]:.3f} of a full step"
              + (f"  argmax agrees {agree[name]:.3f}, head alone {row['head_alone_ms'][name]:.2f} ms"
                 if name in agree else ""))
    print(f"quantizing {rows.shape[0]} head rows to int4 once: {t_quant:.3f} s")
    append_row(args.out, row, echo=False)


if __name__ == "__main__":
    main()
