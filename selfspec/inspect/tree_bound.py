"""How far can a draft tree go past a chain with the same draft? Simulated tokens per round, the oracle bound, prices.

    selfspec-inspect tree-bound results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v8.db \
        --draft results/plans/qwen2.5-coder-1.5b-default.json [--tokens 128] \
        [--groups humaneval gsm8k mtbench summarization] [--branch 0.3 0.6 0.99] [--nodes 8 12] \
        [--k 3 4 6 8 10] [--adaptive 0.2 0.4 0.6] [--fixed] [--grow 8 10] [--stop] [--dtype bfloat16] \
        [--out results/tree_bound.jsonl]

Decodes the study's calibration prompts with our AR (``--tokens`` each) and simulates the draft's rounds on those
continuations (:mod:`selfspec.search.simulate`, exact for greedy decoding):

- ``chain``: the draft with one copy candidate and no branching;
- ``as found``: the draft file as it is;
- ``tree b/n``: 3 copy candidates and the model draft's 2nd-best token beside each position whose top probability
  is under ``b``, at most ``n`` nodes, for every ``--branch`` and ``--nodes``;
- ``oracle``: the chain, with every model-drafted round accepting all it drafted: the tokens per round of a tree that
  always holds the target's continuation to the chain's depth, the most any tree of that depth over this draft
  reaches (copy rounds as the chain's);
- ``chain k=K`` and ``oracle k=K`` for every ``--k``: the same at other depths. A tree drafted in ``K`` sequential
  draft forwards emits at most the tokens of ``oracle k=K`` and costs at least its price, so the best ``oracle k=K``
  bounds the speed of every such tree over this draft (copy rounds as the chain's);
- ``adaptive k=K/t`` for the draft's own depth and every ``--k``, and every ``--adaptive`` threshold ``t``: the draft
  as found, drafting up to ``K`` tokens and stopping after one drafted with probability under ``t`` (the adaptive
  exit, its threshold moving as decoding runs it); with ``--fixed``, ``fixed k=K/t`` too: the same with the threshold
  fixed at ``t`` (``threshold_step: 0``);
- ``grow k=k..K`` for every ``--grow`` ``K`` above the draft's depth ``k``: the draft as found, its model drafts one token longer
  after each round that drafted its full length and had it all accepted, up to ``K``, back to its own depth after
  any other (``k_max``, :class:`~selfspec.engine.speculate.DraftLength`);
- ``stop k=K`` with ``--stop``, for the draft's depth and every ``--k``: the draft as found at depth ``K`` without its
  adaptive exit, each model-drafted chain stopping exactly where the target's continuation does (it drafts the
  tokens it will accept and no more; a round that would accept none takes a plain step): the bound of every rule
  that decides when to stop drafting (an adaptive exit, a learned one), priced as the shorter chains it drafts.

Every variant is priced by a cost model measured now, on the kernels checked out (a tree of ``n`` nodes verifies
``n + 1`` rows; the oracle is priced as the chain, so its price is a bound too). Prints, per group of prompts and
as the mean over the groups, tokens per round, its gain over the chain and the predicted decode speedup, and appends
one JSON line to ``--out``. The study's mix lists its calibration prompts part by part, the same number of each:
``--groups`` names the parts in that order.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.errors import SelfSpecError
from selfspec.provenance import append_row
from selfspec.search.calibration import replay_study
from selfspec.search.costs import costs_for_drafts
from selfspec.search.simulate import RoundSimulator

ORACLE = "oracle"


def variants(spec: DraftSpec, branches: list[float], nodes: list[int], ks: list[int],
             thresholds: list[float] = (), grow: list[int] = (), fixed: bool = False) -> dict[str, DraftSpec]:
    """The chain, the draft as found, its trees, the chain at other depths, the draft with an adaptive exit at
    each depth (moving, and with ``fixed`` fixed too) and the draft growing to each of ``grow``, by name (the oracles
    are chains)."""
    chain = replace(spec, options=replace(spec.options, copy_candidates=1, branch_below=0.0))
    out = {"chain": chain, "as found": spec}
    for k in ks:
        if k != spec.k:
            out[f"chain k={k}"] = replace(chain, k=k)
    for n in nodes:
        out[f"tree copies only/{n}"] = replace(spec, options=replace(spec.options, copy_candidates=3, branch_below=0.0,
                                                                     tree_nodes=n))
        for b in branches:
            out[f"tree {b:g}/{n}"] = replace(spec, options=replace(spec.options, copy_candidates=3, branch_below=b,
                                                                   tree_nodes=n))
    for k in sorted({spec.k, *ks}):
        for t in thresholds:
            out[f"adaptive k={k}/{t:g}"] = replace(spec, k=k, adaptive=True, threshold=t)
            if fixed:
                out[f"fixed k={k}/{t:g}"] = replace(spec, k=k, adaptive=True, threshold=t, threshold_step=0.0)
    for top in grow:
        if top > spec.k:
            out[f"grow k={spec.k}..{top}"] = replace(spec, k_max=top)
    return out


def group_of(n_prompts: int, names: list[str]) -> list[tuple[str, list[int]]]:
    """The prompts' indices by group: ``names`` split the list into equal runs, in order (one group ``all`` without)."""
    if not names:
        return [("all", list(range(n_prompts)))]
    if n_prompts % len(names):
        raise SelfSpecError(f"{n_prompts} prompts do not split into {len(names)} equal groups")
    per = n_prompts // len(names)
    return [(name, list(range(g * per, (g + 1) * per))) for g, name in enumerate(names)]


def study_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments of a subcommand that replays a study's calibration prompts with a draft."""
    ap.add_argument("study", help="the study's storage (.db or .journal): its calibration prompts")
    ap.add_argument("--name", help="the study's name (default: the file's stem)")
    ap.add_argument("--draft", required=True, help="the draft file")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--groups", nargs="*", default=["humaneval", "gsm8k", "mtbench", "summarization"],
                    help="names of the study's parts, in order (none: one group)")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype, as the search ran it")


def replayed(args: argparse.Namespace) -> tuple:
    """What :func:`study_arguments` name: the study's name, its model, the draft, its calibration prompts and their
    groups."""
    name, saved, _, lm = replay_study(args.study, args.name, args.dtype)
    prompts = saved["key"]["prompts"]
    return name, lm, DraftSpec.load(args.draft), prompts, group_of(len(prompts), args.groups)


def ar_continuations(lm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Our AR's greedy continuation of each prompt, ``tokens`` long at most."""
    conts = []
    for i, p in enumerate(prompts, 1):
        print(f"decoding prompt {i}/{len(prompts)} with our AR", file=sys.stderr, flush=True)
        conts.append(autoregressive(lm.model, p, DecodeConfig(max_new_tokens=tokens), lm.eos_ids).tokens)
    return conts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect tree-bound", description=__doc__.split("\n\n")[0])
    study_arguments(ap)
    ap.add_argument("--branch", type=float, nargs="*", default=[0.3, 0.6, 0.99], help="branch_below values to simulate")
    ap.add_argument("--nodes", type=int, nargs="*", default=[8, 12], help="tree_nodes values to simulate")
    ap.add_argument("--k", type=int, nargs="*", default=[3, 4, 6, 8, 10], help="other depths for the chain and oracle")
    ap.add_argument("--adaptive", type=float, nargs="*", default=[0.2, 0.4, 0.6],
                    help="adaptive exit thresholds to simulate at the draft's depth and every --k (none: no such variants)")
    ap.add_argument("--grow", type=int, nargs="*", default=[],
                    help="longest growing model drafts (k_max) to simulate from the draft's depth (none: no such variants)")
    ap.add_argument("--fixed", action="store_true", help="also each adaptive exit with its threshold fixed")
    ap.add_argument("--stop", action="store_true", help="also the stopping oracle at the draft's depth and every --k")
    ap.add_argument("--out", default="results/tree_bound.jsonl")
    args = ap.parse_args(argv)
    name, lm, spec, prompts, groups = replayed(args)
    drafts = variants(spec, args.branch, args.nodes, args.k, args.adaptive, args.grow, args.fixed)
    oracles = {ORACLE: drafts["chain"]} | {n.replace("chain", ORACLE, 1): d for n, d in drafts.items()
                                           if n.startswith("chain k=")}
    stops = {f"stop k={k}": replace(spec, k=k, adaptive=False) for k in sorted({spec.k, *args.k})} if args.stop else {}
    conts = ar_continuations(lm, prompts, args.tokens)
    print("measuring the cost model", file=sys.stderr, flush=True)
    costs = costs_for_drafts(lm, prompts[0] + conts[0], [*drafts.values(), *stops.values()])
    sim = RoundSimulator(lm.model, prompts, conts, lm.eos_ids)
    rows = []
    for label, d in [*drafts.items(), *oracles.items(), *stops.items()]:
        print(f"simulating {label}", file=sys.stderr, flush=True)
        for group, idx in groups:
            counts = sim.simulate(d, prompts=idx, oracle=label in oracles, stop=label in stops)
            rows.append({"variant": label, "group": group, "tokens_per_round": counts.tokens_per_round,
                         "acceptance": counts.acceptance, "decode_speedup": costs.predicted_speedup(counts, d),
                         "rounds": counts.to_dict()})
    by = {(r["variant"], r["group"]): r for r in rows}
    names = [g for g, _ in groups]
    print(f"{len(prompts)} calibration prompts of {name} x {args.tokens} tokens; draft {spec.describe()}; "
          f"prices: a cost model measured now ({costs.machine.get('cpu', '?')}, {costs.machine.get('isa', '?')}, "
          f"{costs.machine.get('kernels', '?')})")
    print("variant".ljust(22) + "".join(f"{g[:13]:>16}" for g in names) + f"{'mean':>16}")
    summary = {}
    for label in [*drafts, *oracles, *stops]:
        tpr = [by[(label, g)]["tokens_per_round"] for g in names]
        gain = [t / by[("chain", g)]["tokens_per_round"] for g, t in zip(names, tpr)]
        speed = [by[(label, g)]["decode_speedup"] for g in names]
        summary[label] = {"tokens_per_round": statistics.mean(tpr), "tokens_gain": statistics.mean(gain),
                          "decode_speedup": statistics.mean(speed),
                          "speed_gain": statistics.mean(s / by[("chain", g)]["decode_speedup"] for g, s in zip(names, speed))}
        cells = [f"{t:.2f} {x - 1:+.0%} {s:.2f}x" for t, x, s in zip(tpr, gain, speed)]
        m = summary[label]
        cells.append(f"{m['tokens_per_round']:.2f} {m['tokens_gain'] - 1:+.0%} {m['decode_speedup']:.2f}x")
        print(label.ljust(22) + "".join(f"{c:>16}" for c in cells))
    print("cells: tokens per round, its gain over the chain, predicted decode speedup over our AR")
    record = {"study": name, "draft": args.draft, "spec": spec.describe(), "tokens": args.tokens, "groups": names,
              "prompts": len(prompts), "rows": rows, "summary": summary, "costs": costs.to_dict()}
    append_row(args.out, record, echo=False)

