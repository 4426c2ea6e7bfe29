"""Which routes could make the draft cheaper, and by how much at best? Each route's best case, priced before it is built.

    selfspec-inspect route-bounds results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v8.db \
        --draft results/plans/qwen2.5-coder-1.5b-default.json [--tokens 128] [--contexts 2048 4096 8192] \
        [--levels 0.25 0.5] [--bits 3 2] [--keep 0.5 0.3] [--skips results/plans/qwen2.5-coder-1.5b-skiponly.json] \
        [--out results/route_bounds.jsonl]

Decodes the study's calibration prompts with our AR (``--tokens`` each) and simulates the draft's rounds on those
continuations (:mod:`selfspec.search.simulate`, exact for greedy decoding). Every route below keeps those rounds
(the draft's acceptance) and changes only what a model-drafted token costs, with what it costs best: each figure
bounds its route from above. Prices come from a cost model measured now, on the kernels checked out.

- ``as found``: the draft as it is.
- ``exit oracle``: a per-token exit inside the draft. For every position of the continuations, the first layer from
  which the draft's token is decided: the model's head on the draft's hidden state there names the draft's final
  token, and so does every later layer (the head scored over the final layer's ``--top`` candidates, which can only
  make an exit earlier). The draft's layers then cost the mean fraction of them a token runs; choosing where to exit
  costs nothing, and the layers a token leaves need no keys later (both optimistic).
- ``second level f``: a cheaper level inside the same model drafts every model token at ``f`` of the draft's
  layers and always agrees with the draft, which checks a round's tokens in one forward at the cost of one draft
  step before the full model verifies them (ML-SpecQD's cascade, without a second model).
- ``bits b``: the draft's layers in ``b``-bit weights at ``b``/4 of their int4 cost (weights read at the memory's
  speed, scales ignored), no acceptance lost. ``bits b, simulated``: the same price for the draft whose int4 layers
  take ``lsq`` groups on 2^b of their 16 levels (``int4_fit: lsq3 | lsq2``, the head kept at 16), simulated: what
  those bits cost in acceptance. Not a bound on acceptance: a measurement; ``int4 lsq, simulated`` is the draft with
  ``lsq`` groups on all 16 levels at its own price, to tell the fit from the bits.
- ``MLP keep f``: the draft's gated MLPs keep the fraction ``f`` of a token's channels, those of the largest
  ``|act(gate(x))|`` (:mod:`selfspec.draft.sparse`), and read their gate weights whole and ``f`` of their up and
  down weights: its MLP sublayers at ``(1 + 2f) / 3`` of their cost (the weights read at the memory's speed, picking
  the channels free), no acceptance lost. ``MLP keep f, simulated``: the same price for the draft with
  ``mlp_keep: f``, simulated: what the sparsity costs in acceptance (a measurement, through the modules rather than
  the fused calls, which round otherwise).
- ``copies inside a round, simulated``: a model-drafted chain turns to copying from the context at the first of
  its tokens after which the last n tokens occurred before (the draft's copy options), the draft's tokens so far
  and the copy verified as one chain (``RoundSimulator.simulate``'s ``copy_inside``). Not a bound: what that policy
  would do on these rounds, at the cost model's prices.
- ``skip everything``: every sublayer of the draft skipped at no acceptance lost (the draft step costs its
  embedding, norms, head and loop overhead): the most layer skipping can save over this draft.
- ``skips of F``: the draft with the sublayers the draft file ``F`` skips (its attention ones, its MLP ones, both),
  simulated: what skipping them really costs in acceptance and saves in time. Not a bound: a measurement.
- ``context L``: a full step, the verifies and the draft's steps timed after ``L`` tokens of context; ``as found``
  there, ``no attention`` with every attention sublayer of the draft skipped at no acceptance lost (the most
  skipping attention can save at that length), and each ``skips of F`` draft at that length (its acceptance from
  the calibration prompts, which are shorter).

Prints each route's predicted decode speedup over our AR per group of prompts and as the mean over the groups, and
appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch

from selfspec.draft.lowbit import FEWER_LEVELS
from selfspec.draft.path import DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.engine.harness import rotated
from selfspec.engine.stats import Clock
from selfspec.inspect.tree_bound import ar_continuations, replayed, study_arguments
from selfspec.kernels.packed import packed_weights
from selfspec.model.arch import arch_of
from selfspec.model.plan import SkipPlan
from selfspec.provenance import append_row
from selfspec.search.costs import CostModel, costs_for_drafts, weight_format
from selfspec.search.rounds import RoundCounts
from selfspec.search.simulate import RoundSimulator

INT4_BITS = 4


def exit_layers(model, path: DraftPath, prompt: list[int], continuation: list[int], top: int = 64) -> torch.Tensor:
    """Layers the draft runs before its token is decided, for each continuation position (module docstring)."""
    layers = arch_of(model).layers
    hidden: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: hidden.append(out[0] if isinstance(out, tuple) else out))
             for layer in layers]
    seq = torch.tensor(prompt + continuation[:-1], dtype=torch.long)
    try:
        with torch.inference_mode(), path.drafting():
            path.prepare(seq)
            model(input_ids=seq[None], use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    with torch.inference_mode():
        norm = model.get_decoder().norm
        head = model.get_output_embeddings().weight
        h = norm(torch.stack([x[0, len(prompt) - 1 :] for x in hidden]))  # [layers, positions, d]
        candidates = (h[-1] @ head.T).topk(top, dim=-1).indices  # [positions, top]
        lens = torch.einsum("lpd,pkd->lpk", h.float(), head[candidates].float()).argmax(-1)
        agrees = lens == lens[-1]
        return len(layers) - agrees.flip(0).int().cumprod(0).sum(0) + 1


def with_layer_costs(costs: CostModel, fmt: str, scale: float, attn: bool = True) -> CostModel:
    """``costs`` with the draft format's per-sublayer costs times ``scale`` (its MLP sublayers' alone where not
    ``attn``)."""
    c = costs.draft[fmt]
    return replace(costs, draft={**costs.draft, fmt: replace(c, attn=c.attn * (scale if attn else 1.0), mlp=c.mlp * scale)})


def mlp_share(keep: float) -> float:
    """What a gated MLP that keeps the fraction ``keep`` of its channels reads of its weights: the gate whole, the
    up rows and down columns of the kept channels."""
    return (1.0 + 2.0 * keep) / 3.0


def second_level(costs: CostModel, counts: RoundCounts, spec: DraftSpec, f: float) -> float:
    """Predicted speedup with a first level at ``f`` of the draft's layers that always agrees (module docstring)."""
    parts = costs.breakdown(counts, spec)
    cheap = with_layer_costs(costs, weight_format(spec.options), f)
    drafted, rounds = counts.model_drafted, counts.model_draft_rounds
    # the cheap level drafts every token; the draft checks them in one step a round, each level's first step of a
    # round priced as the cost model prices it
    t = cheap.draft_time(spec, drafted, rounds) + costs.draft_time(spec, rounds, rounds) + parts["verify"] + parts["plain"]
    return counts.tokens * (costs.t_full + costs.overhead.get("plain_step", 0.0)) / t


def time_at_context(model, spec: DraftSpec, context: list[int], max_verify: int, reps: int = 5,
                    stop_ids=()) -> dict[str, float]:
    """Median seconds after ``context``: a full step, each verify up to ``max_verify`` tokens, the draft's step with
    its attention and with none (round-robin, a warm-up repetition first)."""
    n = spec.plan.num_layers
    no_attn = SkipPlan(n, attn=tuple(range(n)), mlp=spec.plan.mlp)
    paths = {"draft": DraftPath(model, spec.plan, spec.options, stop_ids=stop_ids),
             "draft_no_attn": DraftPath(model, no_attn, spec.options, stop_ids=stop_ids)}
    tokens = torch.tensor(context, dtype=torch.long)
    cache = PositionalKVCache(model, max_len=len(context) + max_verify + 1)
    probe = tokens[-max_verify:]
    clock = Clock()
    fns = {"full": lambda: forward_at(model, cache, probe[:1], len(context), keep=1)}
    for m in range(2, max_verify + 1):
        fns[f"verify{m}"] = lambda m=m: forward_at(model, cache, probe[:m], len(context), keep=1)
    for name, path in paths.items():
        path.prepare(tokens)

        def step(path=path):
            with path.drafting():
                forward_at(model, cache, probe[:1], len(context), keep=1)

        fns[name] = step
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode(), packed_weights(model), decode_attention(model):
        forward_at(model, cache, tokens, 0, keep=1)
        for rep in range(reps + 1):
            for name in rotated(list(fns), rep):
                t0 = clock.now()
                fns[name]()
                if rep:
                    times[name].append(clock.now() - t0)
    return {name: statistics.median(v) for name, v in times.items()}


def at_context(costs: CostModel, spec: DraftSpec, t: dict[str, float]) -> CostModel:
    """``costs`` with the full step, the verifies and the draft's attention timed at a longer context (its MLP
    sublayers, heads and loop overheads as measured; the attention sublayers' cost from the two draft steps)."""
    fmt, n = weight_format(spec.options), spec.plan.num_layers
    kept_attn = n - len(spec.plan.attn)
    c = costs.draft[fmt]
    attn = max(t["draft"] - t["draft_no_attn"], 0.0) / max(kept_attn, 1)
    modelled = costs.step_time(spec) - c.base - kept_attn * c.attn  # the step's MLP sublayers and head savings
    base = max(t["draft"] - kept_attn * attn - modelled, 0.0)
    verify = {m: t[f"verify{m}"] for m in costs.t_verify if f"verify{m}" in t}
    return replace(costs, t_full=t["full"], t_verify=verify,
                   draft={**costs.draft, fmt: replace(c, base=base, attn=attn)})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect route-bounds", description=__doc__.split("\n\n")[0])
    study_arguments(ap)
    ap.add_argument("--levels", type=float, nargs="*", default=[0.5, 0.25], help="second-level layer fractions")
    ap.add_argument("--bits", type=int, nargs="*", default=[3, 2], help="draft weight bits to price")
    ap.add_argument("--contexts", type=int, nargs="*", default=[2048, 4096, 8192], help="context lengths to time")
    ap.add_argument("--keep", type=float, nargs="*", default=[], help="fractions of MLP channels kept to price")
    ap.add_argument("--skips", nargs="*", default=[], help="draft files whose skipped sublayers to try on this draft")
    ap.add_argument("--top", type=int, default=64, help="candidates the exit oracle's head scores")
    ap.add_argument("--out", default="results/route_bounds.jsonl")
    args = ap.parse_args(argv)
    name, lm, spec, prompts, groups = replayed(args)
    fmt = weight_format(spec.options)
    conts = ar_continuations(lm, prompts, args.tokens)
    sim = RoundSimulator(lm.model, prompts, conts, lm.eos_ids)

    def simulated(label: str, d: DraftSpec, copy_inside: bool = False) -> dict[str, RoundCounts]:
        """``d``'s rounds, per group of prompts."""
        print(f"simulating {label}", file=sys.stderr, flush=True)
        return {g: sim.simulate(d, prompts=idx, copy_inside=copy_inside) for g, idx in groups}

    counts = simulated("the draft's rounds", spec)
    inside = simulated("copies inside a round", spec, copy_inside=True) if spec.options.ngram else {}
    n = spec.plan.num_layers
    skipped: dict[str, DraftSpec] = {}
    for f in args.skips:
        plan = DraftSpec.load(f).plan
        for what, attn, mlp in (("attention", plan.attn, ()), ("MLP", (), plan.mlp), ("all", plan.attn, plan.mlp)):
            skipped[f"skips of {Path(f).stem} ({what})"] = replace(spec, plan=SkipPlan(n, attn=tuple(attn), mlp=tuple(mlp)))
    # fewer bits in the draft's layers (lowbit.FEWER_LEVELS), simulated: each with its layers' cost scale
    fits: dict[str, tuple[DraftSpec, float]] = {}
    if fmt.startswith("int4"):
        fits["int4 lsq, simulated"] = (spec.replace(options=replace(spec.options, int4_fit="lsq")), 1.0)
        fits |= {f"bits {b}, simulated": (spec.replace(options=replace(spec.options, int4_fit=f"lsq{b}")), b / INT4_BITS)
                 for b in args.bits if f"lsq{b}" in FEWER_LEVELS}
    fits |= {f"MLP keep {f:g}, simulated": (spec.replace(options=replace(spec.options, mlp_keep=f)), mlp_share(f))
             for f in args.keep}
    skip_counts = {label: simulated(label, d) for label, d in skipped.items()}
    fit_counts = {label: simulated(label, d) for label, (d, _) in fits.items()}
    print("measuring where the draft's tokens are decided", file=sys.stderr, flush=True)
    path = DraftPath(lm.model, spec.plan, spec.options, stop_ids=lm.eos_ids)
    exit_frac = {g: float(torch.cat([exit_layers(lm.model, path, prompts[i], conts[i], args.top) for i in idx])
                          .float().mean()) / n for g, idx in groups}
    print("measuring the cost model", file=sys.stderr, flush=True)
    context = prompts[0] + conts[0]
    costs = costs_for_drafts(lm, context, [spec])
    routes: dict[str, dict[str, float]] = {"as found": {}, "exit oracle": {}, "skip everything": {}}
    nothing_left = with_layer_costs(costs, fmt, 0.0)  # a draft of its embedding, norms and head alone
    for g, _ in groups:
        routes["as found"][g] = costs.predicted_speedup(counts[g], spec)
        routes["skip everything"][g] = nothing_left.predicted_speedup(counts[g], spec)
        for label, d in skipped.items():
            routes.setdefault(label, {})[g] = costs.predicted_speedup(skip_counts[label][g], d)
        if inside:
            routes.setdefault("copies inside a round, simulated", {})[g] = costs.predicted_speedup(inside[g], spec)
        routes["exit oracle"][g] = with_layer_costs(costs, fmt, exit_frac[g]).predicted_speedup(counts[g], spec)
        for f in args.levels:
            routes.setdefault(f"second level {f:g}", {})[g] = second_level(costs, counts[g], spec, f)
        if fmt.startswith("int4"):
            for b in args.bits:
                routes.setdefault(f"bits {b}", {})[g] = with_layer_costs(costs, fmt, b / INT4_BITS).predicted_speedup(
                    counts[g], spec)
        for f in args.keep:
            routes.setdefault(f"MLP keep {f:g}", {})[g] = with_layer_costs(costs, fmt, mlp_share(f), attn=False) \
                .predicted_speedup(counts[g], spec)
        for label, (d, scale) in fits.items():
            priced = with_layer_costs(costs, fmt, scale, attn=d.options.mlp_keep == 1.0)  # sparse MLPs: theirs alone
            routes.setdefault(label, {})[g] = priced.predicted_speedup(fit_counts[label][g], d)
    longest = max(costs.t_verify)
    context_costs = {}
    no_attn = replace(spec, plan=SkipPlan(n, attn=tuple(range(n)), mlp=spec.plan.mlp))
    for length in args.contexts:
        print(f"timing steps after {length} tokens of context", file=sys.stderr, flush=True)
        t = time_at_context(lm.model, spec, (context * (length // len(context) + 1))[:length], longest,
                            stop_ids=lm.eos_ids)
        at = at_context(costs, spec, t)
        context_costs[length] = {"times": t, "draft_step": at.step_time(spec), "t_full": at.t_full,
                                 "attention_share_of_draft_step": (n - len(spec.plan.attn)) * at.draft[fmt].attn
                                 / at.step_time(spec)}
        for g, _ in groups:
            routes.setdefault(f"context {length}", {})[g] = at.predicted_speedup(counts[g], spec)
            routes.setdefault(f"context {length} no attention", {})[g] = at.predicted_speedup(counts[g], no_attn)
            for label, d in skipped.items():
                routes.setdefault(f"context {length} {label}", {})[g] = at.predicted_speedup(skip_counts[label][g], d)
    names = [g for g, _ in groups]
    print(f"{len(prompts)} calibration prompts of {name} x {args.tokens} tokens; draft {spec.describe()}; prices: a "
          f"cost model measured now ({costs.machine.get('cpu', '?')}, {costs.machine.get('isa', '?')}, "
          f"{costs.machine.get('kernels', '?')})")
    print("exit oracle: mean fraction of the draft's layers a token runs " +
          ", ".join(f"{g} {f:.2f}" for g, f in exit_frac.items()))
    for length, c in context_costs.items():
        print(f"context {length}: full step {c['t_full'] * 1e3:.1f} ms, draft step {c['draft_step'] * 1e3:.1f} ms, "
              f"attention {c['attention_share_of_draft_step']:.0%} of the draft step")
    width = max(len(r) for r in routes) + 2
    print("route".ljust(width) + "".join(f"{g[:13]:>15}" for g in names) + f"{'mean':>15}")
    summary = {}
    for route, by in routes.items():
        summary[route] = statistics.mean(by[g] for g in names)
        print(route.ljust(width) + "".join(f"{by[g]:>14.2f}x" for g in names) + f"{summary[route]:>14.2f}x")
    print("predicted decode speedup over our AR (each route's best case; module docstring)")
    record = {"study": name, "draft": args.draft, "spec": spec.describe(), "tokens": args.tokens, "groups": names,
              "prompts": len(prompts), "routes": routes, "summary": summary, "exit_fraction": exit_frac,
              "contexts": context_costs, "counts": {g: c.to_dict() for g, c in counts.items()},
              "copy_inside_counts": {g: c.to_dict() for g, c in inside.items()},
              "skip_counts": {label: {g: c.to_dict() for g, c in by.items()} for label, by in skip_counts.items()},
              "fit_counts": {label: {g: c.to_dict() for g, c in by.items()} for label, by in fit_counts.items()},
              "costs": costs.to_dict()}
    append_row(args.out, record, echo=False)
