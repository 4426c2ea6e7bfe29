"""Cheap, low-noise scoring of skip plans: acceptance without a decode loop, and a cost model.

:class:`AgreementScorer` computes each calibration prompt's full-model greedy
continuation once and keeps the full-model KV cache of the prompt. Scoring a
plan is then one forward of the drafting model over the continuation (on top
of the full-model prompt cache), compared token by token with the
continuation. From that agreement vector it derives, for every draft length
``k``, the expected tokens per round ``1 + E[min(k, run)]`` where ``run`` is
the number of consecutive agreements from a round start.

:class:`CostModel` is measured on this machine: the time of one full-depth
one-token forward, the time each attention and each MLP sublayer adds to it,
and the time of a verify forward over ``k+1`` tokens. The predicted speedup of
a plan at ``k`` is ``tokens_per_round(k) * t_full / (k * t_draft + t_verify(k+1))``.
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from .cache import PositionalKVCache
from .decoding import DecodeConfig, autoregressive, forward_at
from .packed import packed_weights
from .plan import SkipPlan
from .skip import layer_skipper
from .stats import Clock


def tokens_per_round(agree: list[bool], k: int) -> float:
    """Mean over round starts of ``1 + min(k, consecutive agreements from there)``."""
    if not agree:
        return 1.0
    runs = [0] * (len(agree) + 1)
    for i in range(len(agree) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if agree[i] else 0
    return 1.0 + sum(min(k, r) for r in runs[:-1]) / len(agree)


@dataclass
class PlanScore:
    agreement: float  # fraction of continuation tokens the draft predicts
    tokens_per_round: dict[int, float]  # k -> expected tokens per round

    def acceptance(self, k: int) -> float:
        """Predicted accepted/drafted at fixed draft length ``k``."""
        return (self.tokens_per_round[k] - 1.0) / k


class AgreementScorer:
    """Scores plans on calibration prompts against the full model's greedy continuation."""

    def __init__(self, model, prompts: list[list[int]], n_tokens: int, eos_ids=(), k_max: int = 8,
                 continuations: list[list[int]] | None = None) -> None:
        self.model = model
        self.k_max = k_max
        self.skipper = layer_skipper(model)
        self.device = next(model.parameters()).device
        if continuations is None:
            cfg = DecodeConfig(max_new_tokens=n_tokens)
            continuations = [autoregressive(model, p, cfg, eos_ids).tokens for p in prompts]
        self.prompts = [list(p) for p in prompts]
        self.continuations = [list(c) for c in continuations]
        self.caches: list[PositionalKVCache] = []
        with torch.inference_mode():
            for p, c in zip(self.prompts, self.continuations):
                cache = PositionalKVCache(model, max_len=len(p) + max(len(c), 1))
                forward_at(model, cache, self._tensor(p), 0, keep=1)
                self.caches.append(cache)

    def _tensor(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def agreement_vectors(self, plan: SkipPlan) -> list[list[bool]]:
        vectors = []
        with torch.inference_mode(), self.skipper.skipping(plan):
            for p, c, cache in zip(self.prompts, self.continuations, self.caches):
                if len(c) < 2:
                    vectors.append([])
                    continue
                logits = forward_at(self.model, cache, self._tensor(c[:-1]), len(p), keep=len(c) - 1)
                pred = logits.argmax(-1).tolist()
                vectors.append([a == b for a, b in zip(pred, c[1:])])
        return vectors

    def score(self, plan: SkipPlan) -> PlanScore:
        vectors = self.agreement_vectors(plan)
        flat = [x for v in vectors for x in v]
        weights = [len(v) for v in vectors]
        total = sum(weights) or 1
        tpr = {
            k: sum(tokens_per_round(v, k) * w for v, w in zip(vectors, weights)) / total
            for k in range(1, self.k_max + 1)
        }
        return PlanScore(agreement=sum(flat) / max(len(flat), 1), tokens_per_round=tpr)


@dataclass
class CostModel:
    """Seconds on this machine: one full one-token forward, what each sublayer adds, verify passes."""

    t_full: float
    t_attn: float  # per attention sublayer
    t_mlp: float  # per MLP sublayer
    t_verify: dict[int, float]  # tokens in the verify forward (k+1) -> seconds
    num_layers: int

    def draft_time(self, plan: SkipPlan) -> float:
        return max(self.t_full - len(plan.attn) * self.t_attn - len(plan.mlp) * self.t_mlp, 1e-9)

    def predicted_speedup(self, plan: SkipPlan, score: PlanScore) -> tuple[float, int]:
        """Best predicted speedup over k and the k that reaches it."""
        t_draft = self.draft_time(plan)
        best = (0.0, 1)
        for k, tpr in score.tokens_per_round.items():
            if k + 1 not in self.t_verify:
                continue
            s = tpr * self.t_full / (k * t_draft + self.t_verify[k + 1])
            best = max(best, (s, k))
        return best

    def to_dict(self) -> dict:
        d = asdict(self)
        d["t_verify"] = {str(k): v for k, v in self.t_verify.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(d["t_full"], d["t_attn"], d["t_mlp"], {int(k): v for k, v in d["t_verify"].items()}, d["num_layers"])


def measure_costs(model, context: list[int], k_max: int = 8, reps: int = 7, packed: bool = True) -> CostModel:
    """Time the forwards the cost model needs (median of ``reps`` after one warm-up each).

    ``packed``: time them as decoding runs them by default, on the packed weights
    (:mod:`selfspec.packed`).
    """
    skipper = layer_skipper(model)
    n = skipper.num_layers
    device = next(model.parameters()).device
    clock = Clock(device)
    ctx = list(context)
    cache = PositionalKVCache(model, max_len=len(ctx) + k_max + 2)
    tokens = torch.tensor(ctx, dtype=torch.long, device=device)

    def forward(m: int) -> None:
        forward_at(model, cache, tokens[:m], len(ctx), keep=1)

    # every configuration is timed once per repetition, round-robin, so that a change of
    # machine load during the measurement hits all of them alike; medians per configuration
    all_attn = SkipPlan(n, attn=tuple(range(n)))
    all_mlp = SkipPlan(n, mlp=tuple(range(n)))
    configs = [("full", 1, None), ("no_attn", 1, all_attn), ("no_mlp", 1, all_mlp)]
    configs += [(f"verify{m}", m, None) for m in range(2, min(k_max + 1, len(ctx)) + 1)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in configs}

    def run(m: int, plan: SkipPlan | None) -> float:
        with skipper.skipping(plan) if plan is not None else nullcontext():
            t0 = clock.now()
            forward(m)
            return clock.now() - t0

    with torch.inference_mode(), packed_weights(model, packed):
        forward_at(model, cache, tokens, 0, keep=1)
        for rep in range(reps + 1):
            for name, m, plan in configs:
                dt = run(m, plan)
                if rep:  # repetition 0 is the warm-up
                    times[name].append(dt)
    med = {name: statistics.median(v) for name, v in times.items()}
    t_full = med["full"]
    t_verify = {m: med[f"verify{m}"] for _, m, _ in configs if m > 1}
    return CostModel(
        t_full=t_full,
        t_attn=max(t_full - med["no_attn"], 0.0) / n,
        t_mlp=max(t_full - med["no_mlp"], 0.0) / n,
        t_verify=t_verify,
        num_layers=n,
    )
