"""Does the draft's quantization line up with the packaged checkpoint's 4-bit grid? Acceptance, speed and error per fit.

    python scripts/quant_alignment.py results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v8.db \
        --draft results/plans/qwen2.5-coder-1.5b-default.json [--tokens 64] [--out results/quant_alignment.jsonl]

The packaged checkpoints are 4-bit GGUF files dequantized to bf16 (Qwen2.5-Coder: Q4_K_M, whose Q4_K tensors hold
16 even levels in every block of 32 inputs and whose Q6_K tensors hold 64), so an int4 copy in groups of 32 can
give most of their weights back as they were, if each group takes the checkpoint's own levels (``int4_fit:
grid``) rather than its range in 16 steps (``minmax``) or a least-squares refit (``lsq``). Groups of 128 do not
line up and tell what a true bf16 checkpoint would give.

Our AR decodes the study's calibration prompts (``--tokens`` each); the draft as found and its variants with
other int4 groups and fits (everything else kept; the head's int4 rows take the same group and fit), and with its
kept weights as the model's own bf16, are simulated on those continuations (exact for greedy decoding) and priced
by a cost model measured now; the bf16 weights' rounds priced as the draft as found bound what any fit of its
format could give. Where the draft's head is quantized, also the head's share: the draft as found and at each
``grid`` fit with the head's top 8 ids scored again on the model's rows (``head_rescore``), the head in bf16, and
the model itself drafting (layers and head bf16: every token it drafts is the model's, the most any draft of this
shape can accept). Also the relative output error
of each fit's kernel on random inputs, over the linears of a few layers. Prints a table and appends one JSON line
to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import torch

from selfspec.draft.lowbit import LowPrecisionLinear
from selfspec.inspect.tree_bound import ar_continuations, replayed, study_arguments
from selfspec.model.arch import arch_of
from selfspec.provenance import append_row
from selfspec.search.costs import costs_for_drafts
from selfspec.search.simulate import RoundSimulator

GGUF_BLOCK = 32  # the grid fit only where groups can line up with the checkpoint's blocks (wider ones get lsq's)


BOUND = "exact weights at the draft's price"
MODEL = "the model itself drafting (layers and head bf16)"  # every token it drafts is the model's: the ceiling
RESCORE = 8  # the head's top ids scored again on the model's rows (the value searches fix for quantized heads)
RESCORED = f"{{}}, head top {RESCORE} rescored"


def output_error(model, weights: str, group: int, fit: str, layers: list[int]) -> float:
    """||x W_q - x W|| / ||x W|| over the linears of ``layers`` (random bf16 inputs, the real kernels)."""
    torch.manual_seed(0)
    num = den = 0.0
    blocks = arch_of(model).layers
    with torch.inference_mode():
        for i in [i for i in layers if i < len(blocks)]:
            for lin in [m for m in blocks[i].modules() if isinstance(m, torch.nn.Linear)]:
                q = LowPrecisionLinear(lin, weights, group, fit)
                x = torch.randn(16, lin.in_features, dtype=lin.weight.dtype)
                ref = lin(x).float()
                q.active = True
                num += float((q(x).float() - ref).pow(2).sum())
                den += float(ref.pow(2).sum())
    return (num / den) ** 0.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    study_arguments(ap)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 128], help="int4 group sizes to try")
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 9, 18, 27], help="layers whose output error to measure")
    ap.add_argument("--out", default="results/quant_alignment.jsonl")
    ap.set_defaults(tokens=64)
    args = ap.parse_args()
    name, lm, spec, prompts, groups = replayed(args)
    conts = ar_continuations(lm, prompts, args.tokens)
    sim = RoundSimulator(lm.model, prompts, conts, lm.eos_ids)
    o = spec.options
    fits = {f"int4 g{g} {fit}": (g, fit) for g in args.sizes
            for fit in ("minmax", "lsq", "grid")[:3 if g <= GGUF_BLOCK else 2]}
    fit_of = dict(fits)  # each draft's int4 layers, where they are a fit's (the head's variants share their layers')
    drafts = {"as found": spec, "kept weights bf16": spec.replace(options=replace(o, weights="model"))}
    drafts |= {label: spec.replace(options=replace(o, weights="int4", group_size=g, int4_fit=fit))
               for label, (g, fit) in fits.items()}
    if o.head_weights != "model":  # the head's share: its top ids rescored, exact, and the model itself drafting
        bases = [label for label in ("as found", *[f for f in fits if f.endswith("grid")])
                 if not drafts[label].options.head_rescore]
        drafts |= {RESCORED.format(label): spec.replace(options=replace(drafts[label].options, head_rescore=RESCORE))
                   for label in bases}
        fit_of |= {RESCORED.format(label): fit_of[label] for label in bases if label in fit_of}
        drafts["head bf16"] = spec.replace(options=replace(o, head_weights="model", head_rescore=0))
        drafts[MODEL] = spec.replace(options=replace(o, weights="model", head_weights="model", head_rescore=0))
    counts = {}
    for label, d in drafts.items():
        same = next((seen for seen in counts if drafts[seen] == d), None)  # the draft as found is one of the fits
        print(f"simulating {label}: {d.describe()}", file=sys.stderr, flush=True)
        counts[label] = counts[same] if same else {g: sim.simulate(d, prompts=idx) for g, idx in groups}
    print("measuring the cost model", file=sys.stderr, flush=True)
    costs = costs_for_drafts(lm, prompts[0] + conts[0], list(drafts.values()))
    names = [g for g, _ in groups]
    # the most any fit of the draft's format can give: the bf16 weights' rounds at the draft's own price
    counts[BOUND] = counts["kept weights bf16"]
    rows, errors = {}, {}
    for label, d in {**drafts, BOUND: spec}.items():
        by = {g: costs.predicted_speedup(counts[label][g], d) for g in names}
        tokens = sum(c.tokens for c in counts[label].values())
        rounds = sum(c.tokens / c.tokens_per_round for c in counts[label].values() if c.rounds)
        g, fit = fit_of.get(label, (None, None))
        if g and (g, fit) not in errors:  # once per fit: a draft with the head rescored has its fit's layers
            errors[g, fit] = output_error(lm.model, "int4", g, fit, args.layers)
        err = errors.get((g, fit))
        rows[label] = {"spec": d.describe(), "predicted": by, "mean": statistics.mean(by.values()),
                       "tokens_per_round": tokens / rounds, "relative_output_error": err}
    width = max(map(len, rows)) + 2
    print(f"{len(prompts)} calibration prompts of {name} x {args.tokens} tokens; draft {spec.describe()}; prices: a "
          f"cost model measured now ({costs.machine.get('cpu', '?')}, {costs.machine.get('isa', '?')})")
    print("draft".ljust(width) + "".join(f"{g[:12]:>14}" for g in names) + f"{'mean':>10}{'tok/round':>11}{'error':>9}")
    for label, r in rows.items():
        err = f"{r['relative_output_error']:.2%}" if r["relative_output_error"] is not None else "-"
        print(label.ljust(width) + "".join(f"{r['predicted'][g]:>13.2f}x" for g in names)
              + f"{r['mean']:>9.2f}x{r['tokens_per_round']:>11.2f}{err:>9}")
    print("predicted decode speedup over our AR; error: the fit's kernel output against the bf16 linears")
    append_row(args.out, {"study": name, "draft": args.draft, "spec": spec.describe(), "tokens": args.tokens,
                          "prompts": len(prompts), "groups": names, "drafts": rows,
                          "counts": {label: {g: c.to_dict() for g, c in by.items()} for label, by in counts.items()},
                          "costs": costs.to_dict()}, echo=False)


if __name__ == "__main__":
    main()
