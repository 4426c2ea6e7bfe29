"""What a model draft could know at each position besides its own probability, and stop rules that use it.

For each model-drafted round (continuation index ``i``, token ``c[i]`` pending) and each of its positions ``j``, the
decoding loop knows, when it drafts position ``j``:

- ``margin``: the draft's probability of its token less that of its 2nd-best (the draft's own, as its probability);
- ``copy``: +1 where a copy lookup over the context and the tokens drafted before ``j`` (the latest earlier occurrence
  of the longest match of the last 8 down to 2 tokens, prompt lookup's rule) proposes the draft's token, -1 where it
  proposes another, 0 where nothing matched;
- ``start``: the target's probability of the pending token, computed by the verify (or the prefill) before the round;
- ``before``: the share of its drafted tokens that the prompt's previous model-drafted round had right (1 at the
  first).

Rules priced on them: a threshold on the margin; a threshold on the probability that moves with the position; one
threshold on the probability for tokens a copy proposes too and one for the rest; two thresholds split by ``start``
or by ``before`` (at the fitting half's median); and a learned rule, a logistic model of whether a token is right
(fitted on the tokens up to each round's first miss) that stops once its predicted probability falls under a
threshold, on the draft's own features and on all of them. How well each set of features tells the draft's right
tokens from its wrong ones is its held-out AUC.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product

import torch

from selfspec.draft.copy import NGramIndex
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.kernels.packed import packed_weights

COPY_N, COPY_SHORTEST = 8, 2
OWN = ("confidence", "margin", "position")
ALL = (*OWN, "copy agrees", "copy differs", "start", "before")


@dataclass(frozen=True)
class Round:
    """A model-drafted round: the draft's probability at each position, how many of its tokens lead the target's,
    and what else the loop knows there (module docstring)."""

    conf: tuple[float, ...]
    lead: int
    margin: tuple[float, ...] = ()
    copy: tuple[int, ...] = ()
    start: float = 1.0
    before: float = 1.0


Rule = Callable[[Round], int]  # a round -> the tokens it drafts (0: a plain step)


def target_probs(model, prompt: list[int], cont: list[int]) -> list[float]:
    """The target's probability of each token of its own greedy continuation ``cont``, given what precedes it,
    from one forward on the loop's kernels."""
    seq = prompt + cont[:-1]
    with torch.inference_mode(), packed_weights(model), decode_attention(model):
        cache = PositionalKVCache(model, max_len=len(seq))
        logits = forward_at(model, cache, torch.tensor([seq], dtype=torch.long), 0, keep=len(cont)).float()
    probs = logits.log_softmax(-1).gather(-1, torch.tensor(cont)[:, None]).exp()
    return probs[:, 0].tolist()


def copy_proposals(seq: list[int]) -> list[int | None]:
    """At each length ``t`` of ``seq``, the token a copy lookup over ``seq[:t]`` proposes next (None: no match)."""
    index, out = NGramIndex(COPY_N, COPY_SHORTEST), []
    for t in range(len(seq) + 1):
        found = index.propose(1)
        out.append(found[0] if found else None)
        if t < len(seq):
            index.extend([seq[t]])
    return out


def copy_signs(proposals: list[int | None], at: int, drafted: Sequence[int]) -> tuple[int, ...]:
    """+1 / -1 / 0 per drafted token: a copy lookup at sequence length ``at + j`` proposes it / another / nothing."""
    return tuple(0 if proposals[at + j] is None else 1 if proposals[at + j] == t else -1 for j, t in enumerate(drafted))


def _logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))


def vector(r: Round, j: int, names: Sequence[str]) -> list[float]:
    values = {"confidence": _logit(r.conf[j]), "margin": r.margin[j], "position": float(j),
              "copy agrees": float(r.copy[j] > 0), "copy differs": float(r.copy[j] < 0), "start": _logit(r.start),
              "before": r.before}
    return [values[n] for n in names] + [1.0]


def examples(rounds: Sequence[Round]) -> list[tuple[Round, int, bool]]:
    """Each round's tokens up to its first miss, and whether each is right."""
    return [(r, j, j < r.lead) for r in rounds for j in range(min(r.lead + 1, len(r.conf)))]


class Logistic:
    """P(a drafted token is right | its features), fitted by Newton's method with a small L2 penalty."""

    def __init__(self, rounds: Sequence[Round], names: Sequence[str], l2: float = 1e-2, steps: int = 25) -> None:
        self.names = tuple(names)
        data = examples(rounds)
        x = torch.tensor([vector(r, j, names) for r, j, _ in data], dtype=torch.float64)
        y = torch.tensor([float(right) for _, _, right in data], dtype=torch.float64)
        w = torch.zeros(x.shape[1], dtype=torch.float64)
        penalty = l2 * torch.eye(x.shape[1], dtype=torch.float64)
        penalty[-1, -1] = 0.0  # the intercept goes free
        for _ in range(steps):
            p = torch.sigmoid(x @ w)
            grad = x.T @ (p - y) + penalty @ w
            hess = (x.T * (p * (1 - p))) @ x + penalty
            w = w - torch.linalg.solve(hess, grad)
        self.w = w
        self.scores: dict[tuple[int, int], float] = {}  # (id of a round, position) -> its score, once

    def __call__(self, r: Round, j: int) -> float:
        key = (id(r), j)
        if key not in self.scores:
            self.scores[key] = float(torch.sigmoid(torch.tensor(vector(r, j, self.names), dtype=torch.float64) @ self.w))
        return self.scores[key]


def stop_under(score: Callable[[Round, int], float], t: float) -> Rule:
    """Stop after the first position whose score is under ``t``."""
    def rule(r: Round) -> int:
        return next((j + 1 for j in range(len(r.conf)) if score(r, j) < t), len(r.conf))
    return rule


def exit_below(threshold: Callable[[Round, int], float]) -> Rule:
    """Stop after the first token drafted with probability under ``threshold(round, position)``."""
    def rule(r: Round) -> int:
        return next((j + 1 for j, p in enumerate(r.conf) if p < threshold(r, j)), len(r.conf))
    return rule


def by_copy(agreed: float, other: float) -> Rule:
    """The exit at ``agreed`` for a token a copy proposes too, at ``other`` for the rest."""
    return exit_below(lambda r, j: agreed if r.copy[j] > 0 else other)


def by_margin(t: float) -> Rule:
    """Stop after the first token drafted with a margin over the 2nd-best under ``t``."""
    return stop_under(lambda r, j: r.margin[j], t)


def rising(start: float, slope: float) -> Rule:
    """The exit at ``start + slope * j`` at position ``j``."""
    return exit_below(lambda r, j: start + slope * j)


def by_round(feature: str, split: float, high: float, low: float) -> Rule:
    """The exit at ``high`` in rounds whose ``feature`` is at least ``split``, at ``low`` in the others."""
    return exit_below(lambda r, j: high if getattr(r, feature) >= split else low)


def auc(scores: Sequence[float], right: Sequence[bool]) -> float:
    """The chance that a right token scores above a wrong one (ties count a half)."""
    pos = sorted(s for s, y in zip(scores, right) if y)
    neg = [s for s, y in zip(scores, right) if not y]
    if not pos or not neg:
        return float("nan")
    wins = sum(len(pos) - bisect_right(pos, s) + 0.5 * (bisect_right(pos, s) - bisect_left(pos, s)) for s in neg)
    return wins / (len(pos) * len(neg))


def halves(rounds: Sequence[Round], seed: int) -> tuple[list[Round], list[Round]]:
    order = list(range(len(rounds)))
    random.Random(seed).shuffle(order)
    cut = len(order) // 2
    return [rounds[i] for i in order[:cut]], [rounds[i] for i in order[cut:]]


def held_out_auc(rounds: Sequence[Round], names: Sequence[str] | None, seed: int) -> float:
    """AUC of the draft's probability (``names`` None) or of a logistic model fitted on the other half."""
    scores, labels = [], []
    one, two = halves(rounds, seed)
    for held, other in ((one, two), (two, one)):
        model = Logistic(other, names) if names else None
        for r, j, right in examples(held):
            scores.append(model(r, j) if model else r.conf[j])
            labels.append(right)
    return auc(scores, labels)


Price = Callable[[Sequence[Round], Rule], float]  # rounds, a rule -> how well the rule does on them


def best_args(price: Price, rounds: Sequence[Round], family: Callable[..., Rule], *axes: Sequence[float]) -> tuple:
    """The arguments, one from each axis, at which ``family`` prices best on ``rounds`` (the first of equals)."""
    return max(product(*axes), key=lambda args: price(rounds, family(*args)))


def fit(price: Price, rounds: Sequence[Round], family: Callable[..., Rule], *axes: Sequence[float]) -> Rule:
    """``family`` at its best arguments on ``rounds``."""
    return family(*best_args(price, rounds, family, *axes))


def fitted_rules(price: Price, grid: Sequence[float], prob_grid: Sequence[float]) -> dict[str, Callable[[list[Round]], Rule]]:
    """Each rule of this module as a fit: rounds -> the rule with its thresholds chosen on them by ``price``."""
    def split(feature: str) -> Callable[[list[Round]], Rule]:
        def fitting(rounds: list[Round]) -> Rule:
            at = sorted(getattr(r, feature) for r in rounds)[len(rounds) // 2]
            return fit(price, rounds, lambda high, low: by_round(feature, at, high, low), grid, grid)
        return fitting

    def learned(names: Sequence[str]) -> Callable[[list[Round]], Rule]:
        def fitting(rounds: list[Round]) -> Rule:
            model = Logistic(rounds, names)
            return fit(price, rounds, lambda t: stop_under(model, t), prob_grid)
        return fitting

    slopes = (-0.05, -0.025, 0.0, 0.025, 0.05, 0.075, 0.1)
    return {"by the margin": lambda rs: fit(price, rs, by_margin, grid),
            "rising with the position": lambda rs: fit(price, rs, rising, grid, slopes),
            "by copy agreement": lambda rs: fit(price, rs, by_copy, grid, grid), "by the target's start": split("start"),
            "by the round before": split("before"), "learned, the draft's own": learned(OWN),
            "learned, all": learned(ALL)}
