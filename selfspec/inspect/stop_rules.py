"""Where should a model draft stop? Rules on the draft's own probabilities, priced on the same rounds as the oracle.

    selfspec-inspect stop-rules results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v8.db \
        --draft results/plans/qwen2.5-coder-1.5b-zen4-exit.json [--k 8] [--tokens 128] \
        [--thresholds 0.1 0.2 ...] [--out results/stop_rules.jsonl]

Decodes the study's calibration prompts with our AR (``--tokens`` each) and simulates the draft as a chain of depth
``--k`` without an exit (:mod:`selfspec.search.simulate`), keeping the draft's outputs over all ``k`` positions of
every model-drafted round: at position ``j`` its token and that token's probability, given the target's tokens
before it. On those rounds, the same round starts for every rule, it prices:

- ``fixed t``: stop after the first token drafted with probability under ``t`` (the exit fixed at ``t``);
- ``prefix t``: stop once the product of the probabilities drafted so far is under ``t`` (the draft's own estimate
  that its round is still right);
- ``calibrated prefix t``: the same with each probability replaced by the share of the tokens drafted at that
  probability (in tenths) that the target took;
- ``oracle``: each round drafts what the target will accept (a round that accepts none is a plain step), the bound
  of every stop rule over this draft at this depth.

The grids are priced on all rounds (in sample). A rule is also fitted on one half of the rounds and priced on the
other, both ways (``... fitted``, cross-validated): ``fixed``, ``prefix`` and ``calibrated prefix`` pick their ``t``,
``positions`` one threshold per position (coordinate ascent over ``--thresholds``): a learned rule. Every rule is
priced by a cost model measured now, each round as a model-drafted chain of the length it drafts (predicted decode
speedup over our AR on these rounds; copy rounds are left out). By the draft's probability in tenths it prints how
many tokens were drafted there up to the round's first miss and the share of them the target took: how well the
draft's probability tells its right tokens from its wrong ones. And, by the fixed exit's threshold, the share of the
model's rounds that the target accepts whole (what a draft run ahead of the verify could count on).

Then the rules that use more than the draft's probability (:mod:`selfspec.inspect.stop_features`: the margin over
the 2nd-best token, a threshold moving with the position, agreement with a copy lookup, the target's probability of
the round's pending token, the round before, a learned rule), each fitted on one half of the rounds and priced on
the other over ``--splits`` random halvings, beside the fixed exit fitted on the same halves; the held-out AUC of
each set of features; and the learned rule's weights fitted on all rounds. Appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from selfspec.draft.spec import DraftSpec
from selfspec.inspect.stop_features import (
    ALL,
    OWN,
    Logistic,
    Round,
    Rule,
    best_args,
    copy_proposals,
    copy_signs,
    exit_below,
    fit,
    fitted_rules,
    halves,
    held_out_auc,
    target_probs,
)
from selfspec.inspect.tree_bound import ar_continuations, replayed, study_arguments
from selfspec.provenance import append_row
from selfspec.search.costs import CostModel, costs_for_drafts
from selfspec.search.rounds import RoundCounts, forward_key, leading_agreements
from selfspec.search.simulate import RoundSimulator

BINS = 10  # the draft's probability in tenths


def model_rounds(sim: RoundSimulator, spec: DraftSpec, starts: Sequence[Sequence[float]] | None = None) -> list[Round]:
    """The model-drafted rounds of ``spec`` (a chain without an exit) on the simulator's continuations, each with
    all the positions it could draft and what else the loop knows there (:mod:`selfspec.inspect.stop_features`;
    ``starts``: the target's probability of each continuation token, 1 where not given)."""
    sim.simulate(spec)
    out, seen = [], {}
    proposals = [copy_proposals(p + c) for p, c in zip(sim.prompts, sim.continuations)]
    for (b, i), drafted in sorted(sim.memo[forward_key(spec)].items()):
        c = sim.continuations[b]
        n = min(spec.k, len(drafted), len(c) - i - 2)  # the loop drafts at most what is left before the last token
        if n < 1:
            continue
        lead = leading_agreements(list(drafted.pred[:n]), c[i + 1 : i + 1 + n])
        # position j is drafted after c[:i+1+j] (the tokens drafted before it are the target's while they agree)
        out.append(Round(drafted.conf[:n], lead,
                         tuple(a - b for a, b in zip(drafted.conf[:n], drafted.second_conf[:n])),
                         copy_signs(proposals[b], len(sim.prompts[b]) + i + 1, drafted.pred[:n]),
                         starts[b][i] if starts is not None else 1.0, seen.get(b, 1.0)))
        seen[b] = lead / n
    return out


def _bin(p: float) -> int:
    return min(int(p * BINS), BINS - 1)


def calibration(rounds: Sequence[Round]) -> list[tuple[int, int]]:
    """Per tenth of the draft's probability: (tokens drafted there up to each round's first miss, those right)."""
    seen, right = [0] * BINS, [0] * BINS
    for r in rounds:
        for j, p in enumerate(r.conf[: r.lead + 1]):
            seen[_bin(p)] += 1
            right[_bin(p)] += j < r.lead
    return list(zip(seen, right))


def shares(table: list[tuple[int, int]]) -> list[float]:
    """The share right per tenth, with one right and one wrong token added (a tenth with no tokens reads 0.5)."""
    return [(right + 1) / (seen + 2) for seen, right in table]


def first_under(thresholds: Sequence[float]) -> Rule:
    """Stop after the first token drafted with probability under its position's threshold (the last one repeats)."""
    return exit_below(lambda r, j: thresholds[min(j, len(thresholds) - 1)])


def fixed(t: float) -> Rule:
    """The exit fixed at ``t``: stop after the first token drafted with probability under it."""
    return first_under([t])


def prefix_under(t: float, table: list[float] | None = None) -> Rule:
    """Stop once the product of the probabilities drafted so far (or of their tenths' shares in ``table``) is
    under ``t``."""
    def rule(r: Round) -> int:
        prod = 1.0
        for j, p in enumerate(r.conf):
            prod *= table[_bin(p)] if table is not None else p
            if prod < t:
                return j + 1
        return len(r.conf)
    return rule


def oracle(r: Round) -> int:
    return r.lead


def whole_share(rounds: Sequence[Round], rule: Rule) -> float:
    """The share of the rounds the model drafts (the rule drafts a token or more) that the target accepts whole."""
    drafted = [(rule(r), r.lead) for r in rounds]
    drafted = [(d, lead) for d, lead in drafted if d > 0]
    return sum(d <= lead for d, lead in drafted) / len(drafted) if drafted else 0.0


def counts_of(pairs: Sequence[tuple[Round, Rule]]) -> RoundCounts:
    """The rounds, each drafting what its rule says, as chain rounds of the simulator's counts."""
    counts = RoundCounts()
    for r, rule in pairs:
        d = rule(r)
        if d == 0:
            counts.plain_steps += 1
            counts.tokens += 1
            continue
        a = min(r.lead, d)
        counts.model_rounds[d] += 1
        counts.drafted += d
        counts.accepted += a
        counts.tokens += a + 1
    return counts


class Pricer:
    """Predicted decode speedup of a rule on rounds, by one cost model."""

    def __init__(self, costs: CostModel, spec: DraftSpec) -> None:
        self.costs, self.spec = costs, spec

    def __call__(self, rounds: Sequence[Round], rule: Rule) -> float:
        return self.speed(counts_of([(r, rule) for r in rounds]))

    def speed(self, counts: RoundCounts) -> float:
        return self.costs.predicted_speedup(counts, self.spec)

    def positions(self, rounds: Sequence[Round], k: int, grid: Sequence[float], sweeps: int = 2) -> list[float]:
        """One threshold per position, by coordinate ascent from the best single threshold."""
        ts = [*best_args(self, rounds, fixed, grid)] * k
        for _ in range(sweeps):
            for j in range(k):
                ts[j] = max(grid, key=lambda t: self(rounds, first_under([*ts[:j], t, *ts[j + 1 :]])))
        return ts


def cross_validated(rounds: list[Round], fitting: Callable[[list[Round]], Rule], seed: int = 0) -> RoundCounts:
    """Each half's rounds drafted by the rule fitted on the other half."""
    pairs = []
    one, two = halves(rounds, seed)
    for held, other in ((one, two), (two, one)):
        rule = fitting(other)
        pairs += [(r, rule) for r in held]
    return counts_of(pairs)


def beyond_the_draft(rounds: list[Round], price: Pricer, grid: Sequence[float], splits: int) -> dict:
    """The rules of :mod:`selfspec.inspect.stop_features`, each cross-validated over ``splits`` random halvings
    beside the fixed exit fitted on the same halves, and the held-out AUC of each set of features; printed."""
    fits = {"fixed": lambda rs: fit(price, rs, fixed, grid)} | fitted_rules(price, grid, [i / 20 for i in range(20)])
    speeds = {label: [price.speed(cross_validated(rounds, fitting, seed)) for seed in range(splits)]
              for label, fitting in fits.items()}
    aucs = {label: [held_out_auc(rounds, names, seed) for seed in range(splits)]
            for label, names in (("the draft's probability", None), ("learned, the draft's own", OWN),
                                 ("learned, all", ALL))}
    print(f"fitted on one half, priced on the other, over {splits} random halvings (mean, and over fixed: mean, range)")
    for label, s in speeds.items():
        over = [a / b for a, b in zip(s, speeds["fixed"])]
        print(label.ljust(30) + f"{sum(s) / len(s):>9.2f}x{sum(over) / len(over):>10.3f} ({min(over):.3f}-{max(over):.3f})")
    print("held-out AUC, right tokens against wrong ones (mean, range)")
    for label, a in aucs.items():
        print(label.ljust(30) + f"{sum(a) / len(a):>9.3f} ({min(a):.3f}-{max(a):.3f})")
    weights = {label: dict(zip((*names, "intercept"), Logistic(rounds, names).w.tolist()))
               for label, names in (("the draft's own", OWN), ("all", ALL))}
    for label, w in weights.items():
        print(f"logistic weights on all rounds, {label}: " + ", ".join(f"{n} {v:+.2f}" for n, v in w.items()))
    return {"splits": splits, "decode_speedup": speeds, "auc": aucs, "weights": weights}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect stop-rules", description=__doc__.split("\n\n")[0])
    study_arguments(ap)
    ap.add_argument("--k", type=int, default=8, help="the draft's depth")
    ap.add_argument("--thresholds", type=float, nargs="+", default=[i / 20 for i in range(16)],
                    help="the thresholds every rule may take")
    ap.add_argument("--splits", type=int, default=5,
                    help="random halvings of the rounds that the rules using more than the draft's probability are "
                         "cross-validated over")
    ap.add_argument("--out", default="results/stop_rules.jsonl")
    args = ap.parse_args(argv)
    name, lm, spec, prompts, _ = replayed(args)
    chain = replace(spec, k=args.k, adaptive=False, options=replace(spec.options, copy_candidates=1,
                                                                               branch_below=0.0, copy_fallback=0))
    priced = replace(chain, adaptive=True, threshold_step=0.0)  # each draft step pays the exit's probability
    conts = ar_continuations(lm, prompts, args.tokens)
    print("measuring the cost model", file=sys.stderr, flush=True)
    costs = costs_for_drafts(lm, prompts[0] + conts[0], [priced])
    print("the target's probabilities of its continuations", file=sys.stderr, flush=True)
    starts = [target_probs(lm.model, p, c) for p, c in zip(prompts, conts)]
    sim = RoundSimulator(lm.model, prompts, conts, lm.eos_ids, lazy=False)
    rounds = model_rounds(sim, chain, starts)
    price, grid = Pricer(costs, priced), args.thresholds
    table = calibration(rounds)
    in_sample = shares(table)
    families: dict[str, Callable[[float], Rule]] = {
        "fixed": fixed, "prefix": prefix_under, "calibrated prefix": lambda t: prefix_under(t, in_sample)}
    rules = {f"{family} {t:g}": counts_of([(r, rule_of(t)) for r in rounds])
             for family, rule_of in families.items() for t in grid}
    rules["fixed, fitted"] = cross_validated(rounds, lambda rs: fit(price, rs, fixed, grid))
    rules["prefix, fitted"] = cross_validated(rounds, lambda rs: fit(price, rs, prefix_under, grid))

    def calibrated(rs: list[Round]) -> Rule:
        own = shares(calibration(rs))
        return fit(price, rs, lambda t: prefix_under(t, own), grid)

    rules["calibrated prefix, fitted"] = cross_validated(rounds, calibrated)
    rules["positions, fitted"] = cross_validated(rounds, lambda rs: first_under(price.positions(rs, args.k, grid)))
    rules["oracle"] = counts_of([(r, oracle) for r in rounds])
    summary = {label: {"decode_speedup": price.speed(c), "tokens_per_round": c.tokens_per_round,
                       "drafted": c.drafted, "accepted": c.accepted, "tokens": c.tokens, "plain_steps": c.plain_steps}
               for label, c in rules.items()}
    print(f"{len(rounds)} model-drafted rounds of {len(prompts)} calibration prompts of {name} x {args.tokens} tokens; "
          f"draft {chain.describe()}; prices: a cost model measured now ({costs.machine.get('cpu', '?')}, "
          f"{costs.machine.get('isa', '?')}, {costs.machine.get('kernels', '?')})")
    print("the draft's probability   tokens   right")
    for b, (seen, right) in enumerate(table):
        print(f"  {b / BINS:.1f}-{(b + 1) / BINS:.1f}".ljust(26) + f"{seen:>6}   " + (f"{right / seen:.2f}" if seen else "-"))
    base = summary["fixed, fitted"]["decode_speedup"]
    print("rule".ljust(30) + f"{'speedup':>10}{'over fixed, fitted':>20}{'tokens a round':>16}{'drafted':>9}")
    for label, s in summary.items():
        print(label.ljust(30) + f"{s['decode_speedup']:>9.2f}x{s['decode_speedup'] / base:>20.3f}"
              f"{s['tokens_per_round']:>16.2f}{s['drafted']:>9}")
    whole = {f"{t:g}": round(whole_share(rounds, fixed(t)), 4) for t in grid}
    print("share of the model's rounds accepted whole, by the fixed exit's threshold: "
          + ", ".join(f"{t} {w:.2f}" for t, w in whole.items()))
    outside = beyond_the_draft(rounds, price, grid, args.splits)
    record = {"study": name, "draft": args.draft, "spec": chain.describe(), "k": args.k, "tokens": args.tokens,
              "prompts": len(prompts), "rounds": len(rounds), "calibration": [list(x) for x in table],
              "summary": summary, "accepted_whole": whole, "outside": outside, "costs": costs.to_dict()}
    append_row(args.out, record, echo=False)
