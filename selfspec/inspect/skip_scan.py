"""Does any sublayer pay its way skipped on top of a draft? A greedy scan, each candidate simulated and priced.

    selfspec-inspect skip-scan results/optuna/qwen2.5-coder-1.5b-longchat.db \
        --draft results/plans/qwen2.5-coder-1.5b-longchat.json --groups [--tokens 64] [--steps 2] \
        [--kinds attn mlp] [--write draft.json] [--out results/skip_scan.jsonl]

Decodes the study's calibration prompts with our AR (``--tokens`` each) and simulates, on those continuations
(:mod:`selfspec.search.simulate`, exact for greedy decoding), the draft with one more sublayer skipped, for every
sublayer it keeps (the first and the last layer stay, as the search keeps them): what the skip costs in
acceptance is simulated, what it saves is priced by a cost model measured now at the first prompt's length (a
sublayer's cost there, from whole draft forwards without it). The best candidate joins the draft and the scan
runs again, ``--steps`` times, whether or not the last step paid: a skip set that pays only as a whole shows as a
later step above 1. Prints each step's best candidates, their tokens per round and predicted decode speedup
against the draft as found, and appends one JSON line to ``--out``; ``--write`` saves the draft with every step's
skip added (to measure it in a real run, e.g. ``+experiment=long_context``).

Where the search never keeps a skip (its trials with skips are few, and TPE leaves that region early), this asks
the question directly, one sublayer at a time, on the draft the search chose.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

from selfspec.draft.spec import DraftSpec
from selfspec.inspect.tree_bound import ar_continuations, replayed, study_arguments
from selfspec.provenance import append_row
from selfspec.search.costs import costs_for_drafts
from selfspec.search.simulate import RoundSimulator


def with_skip(spec: DraftSpec, kind: str, layer: int) -> DraftSpec:
    """``spec`` with the ``kind`` (attn | mlp) sublayer of ``layer`` skipped too."""
    plan = spec.plan
    attn, mlp = set(plan.attn), set(plan.mlp)
    (attn if kind == "attn" else mlp).add(layer)
    return spec.replace(plan=replace(plan, attn=tuple(sorted(attn)), mlp=tuple(sorted(mlp))))


def scanned_draft(spec: DraftSpec, record: dict) -> DraftSpec:
    """``spec`` with every step's best skip of a scan's ``record`` added; what it carries as measured is the scan's
    derivation and prediction, not the measurements of the draft it came from (as the ablation's drafts)."""
    for step in record["steps"]:
        best = step["candidates"][0]
        spec = with_skip(spec, best["kind"], best["layer"])
    last = record["steps"][-1]["candidates"][0] if record["steps"] else record["as_found"]
    return spec.replace(measured={"skip_scan_of": record["draft"], "study": record["study"],
                                  "added": [[s["candidates"][0]["kind"], s["candidates"][0]["layer"]]
                                            for s in record["steps"]],
                                  "predicted_decode_speedup": last["decode_speedup"],
                                  "as_found_predicted_decode_speedup": record["as_found"]["decode_speedup"]})


def candidates(spec: DraftSpec, kinds: list[str]) -> list[tuple[str, int]]:
    """The sublayers ``spec`` keeps, of ``kinds``, but in its first and last layer."""
    n, plan = spec.plan.num_layers, spec.plan
    skipped = {"attn": set(plan.attn), "mlp": set(plan.mlp)}
    return [(kind, i) for kind in kinds for i in range(1, n - 1) if i not in skipped[kind]]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect skip-scan", description=__doc__.split("\n\n")[0])
    study_arguments(ap)
    ap.add_argument("--steps", type=int, default=2, help="sublayers added one after the other")
    ap.add_argument("--kinds", nargs="+", default=["attn", "mlp"], choices=["attn", "mlp"])
    ap.add_argument("--show", type=int, default=5, help="candidates printed per step")
    ap.add_argument("--write", help="save the draft with the scan's skips added to this file")
    ap.add_argument("--out", default="results/skip_scan.jsonl")
    args = ap.parse_args(argv)
    name, lm, spec, prompts, groups = replayed(args)
    conts = ar_continuations(lm, prompts, args.tokens)
    print("measuring the cost model", file=sys.stderr, flush=True)
    costs = costs_for_drafts(lm, prompts[0] + conts[0], [spec])
    sim = RoundSimulator(lm.model, prompts, conts, lm.eos_ids)

    def price(d: DraftSpec) -> dict:
        per = {}
        for group, idx in groups:
            counts = sim.simulate(d, prompts=idx)
            per[group] = {"tokens_per_round": counts.tokens_per_round, "acceptance": counts.acceptance,
                          "decode_speedup": costs.predicted_speedup(counts, d)}
        return {"decode_speedup": statistics.mean(p["decode_speedup"] for p in per.values()),
                "tokens_per_round": statistics.mean(p["tokens_per_round"] for p in per.values()), "groups": per}

    base = price(spec)
    print(f"{len(prompts)} calibration prompts of {name} x {args.tokens} tokens; draft {spec.describe()}; "
          f"as found {base['decode_speedup']:.3f}x, {base['tokens_per_round']:.2f} tokens a round; prices: a cost model "
          f"measured now at {len(prompts[0]) + len(conts[0])} tokens ({costs.machine.get('cpu', '?')}, "
          f"{costs.machine.get('isa', '?')})")
    steps, current = [], spec
    for step in range(1, args.steps + 1):
        scored = []
        for i, (kind, layer) in enumerate(candidates(current, args.kinds), 1):
            print(f"\rstep {step}: simulating {kind} {layer} ({i})", end="", file=sys.stderr, flush=True)
            scored.append({"kind": kind, "layer": layer, **price(with_skip(current, kind, layer))})
        print(file=sys.stderr)
        scored.sort(key=lambda c: -c["decode_speedup"])
        best = scored[0]
        current = with_skip(current, best["kind"], best["layer"])
        steps.append({"step": step, "attn": list(current.plan.attn), "mlp": list(current.plan.mlp),
                      "candidates": scored})
        print(f"step {step}: {len(scored)} sublayers tried; best, over the draft as found:")
        for c in scored[: args.show]:
            print(f"  {c['kind']:<4} {c['layer']:>3}  {c['tokens_per_round']:.2f} tokens a round  "
                  f"{c['decode_speedup']:.3f}x  ({c['decode_speedup'] / base['decode_speedup']:.3f})")
    record = {"study": name, "draft": args.draft, "spec": spec.describe(), "tokens": args.tokens,
              "groups": [g for g, _ in groups], "prompts": len(prompts), "kinds": args.kinds, "as_found": base,
              "steps": steps, "costs": costs.to_dict()}
    append_row(args.out, record, echo=False)
    if args.write:
        print(f"the draft with its {args.steps} added skips written to {scanned_draft(spec, record).save(args.write)}")
