"""What a full-depth forward costs as a function of its width (tokens verified at once).

    python scripts/verify_width.py [--model qwen2.5-coder-0.5b] [--widths 1 2 4 8 16 32] [--reps 9]
                                   [--kernels packed [onednn panels amx stock]]

On the packed weights decoding uses (``stock``: the weights as loaded; ``onednn``: bf16 packed for oneDNN;
``panels``: exact fp16 copies on our fp16 panel kernel; ``amx``: the bf16 weights on our AMX tile kernel; any of them
whatever this CPU's own packing is), after a prefill of one calibration prompt, times a forward over ``m`` tokens at
the end of the context for each width (the prompt's tokens, again past its length), round-robin (so load changes hit
all widths alike), with a chain mask (the model's own causal mask) and, for widths >= 3, with a draft tree's mask (a
star: every node a child of the first), which is what a tree verify adds. With more than one of ``--kernels``, each
has a model instance of its own, timed in the same rotation (each turn after an untimed forward), and
``over_first_kernel`` gives each width's median over the first kernel's. Prints and appends one JSON line (medians,
and the ratio to the one-token forward) to --out.
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
from selfspec.kernels import amx, fp16
from selfspec.kernels.packed import kernels_label, packed_weights, weight_packer
from selfspec.provenance import append_row, git_commit, machine_fingerprint

KINDS = {"packed": None, "onednn": "bf16", "panels": "fp16", "amx": "amx", "stock": None}  # --kernels -> the packing asked for


def kernel_name(kernels: str) -> str:
    if kernels == "onednn":
        return "packed bf16"  # the name its rows have carried (kernels_label's is "packed")
    return kernels_label(kernels != "stock", KINDS[kernels])


def time_turn(model, cache, ctx, prompt_len, configs, trees, clock) -> dict[str, float]:
    """One kernel's turn: each config's forward timed once, after an untimed forward at the first config's width. The
    first forward after another model instance's turn can run far slower (seen on a 2-core Xeon with either kernel),
    which would otherwise fall on whichever width is timed first."""
    forward_at(model, cache, ctx[:configs[0][1]], prompt_len, keep=configs[0][1])
    out = {}
    for name, m, kind in configs:
        tokens = ctx[:m]
        t0 = clock.now()
        if kind:
            mask, depth = trees[m]
            forward_at(model, cache, tokens, prompt_len, keep=m, position_ids=prompt_len + depth, attention_mask=mask)
        else:
            forward_at(model, cache, tokens, prompt_len, keep=m)
        out[name] = clock.now() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 6, 8, 12, 16, 24, 32])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--kernels", nargs="+", choices=list(KINDS), default=["packed"],
                    help="the packed weights decoding uses on this CPU, oneDNN's bf16 packs, our fp16 panel kernel's "
                         "copies, our AMX kernel's panels, or the weights as loaded; several: one model instance each, "
                         "timed in turn")
    ap.add_argument("--out", default="results/verify_width.jsonl")
    args = ap.parse_args()
    if "panels" in args.kernels and not fp16.available():
        ap.error(f"--kernels panels: the fp16 panel kernel does not run here ({fp16.unavailable_reason()})")
    if "amx" in args.kernels and not amx.available():
        ap.error(f"--kernels amx: our AMX kernel does not run here ({amx.unavailable_reason()})")
    kernels = list(dict.fromkeys(args.kernels))
    models = {}
    for kernels_ in kernels:
        lm = load_model(args.model)
        if kernels_ != "stock":
            weight_packer(lm.model, kind=KINDS[kernels_])
        models[kernels_] = lm
    prompt = calibration_prompts(lm.tokenizer, ["humaneval"], 1)[0]
    ctx = torch.tensor(prompt, dtype=torch.long)
    widest = max(args.widths)
    feed = ctx.repeat(-(-widest // len(prompt)))  # the forwards' tokens: the prompt again, for widths beyond it
    caches = {k: PositionalKVCache(lm.model, max_len=len(prompt) + widest) for k, lm in models.items()}
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
    times = {k: {name: [] for name, _, _ in configs} for k in kernels}
    with torch.inference_mode():
        for k, lm in models.items():
            with packed_weights(lm.model, on=k != "stock"):
                forward_at(lm.model, caches[k], ctx, 0, keep=1)
        for rep in range(args.reps + 1):
            for k in kernels[rep % len(kernels):] + kernels[:rep % len(kernels)]:
                with packed_weights(models[k].model, on=k != "stock"):
                    turn = time_turn(models[k].model, caches[k], feed, len(prompt), configs, trees, clock)
                if rep:  # repetition 0 is the warm-up
                    for name, dt in turn.items():
                        times[k][name].append(dt)
    med = {k: {name: statistics.median(v) for name, v in per.items()} for k, per in times.items()}
    narrow = str(min(args.widths))
    first = med[kernels[0]]
    machine, commit = machine_fingerprint(), git_commit()  # before the first row is appended to --out
    for k in kernels:
        res = {"model": args.model, "kernels": kernel_name(k), "context_tokens": len(prompt), "reps": args.reps,
               "median_ms": {n: round(v * 1e3, 2) for n, v in med[k].items()},
               "over_narrowest": {n: round(v / med[k][narrow], 3) for n, v in med[k].items()},
               "machine": machine, "git_commit": commit}
        if len(kernels) > 1:
            res["timed_with"] = [kernel_name(o) for o in kernels if o != k]
            res["over_first_kernel"] = {n: round(v / first[n], 3) for n, v in med[k].items()}
        print(json.dumps(res), flush=True)
        append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
