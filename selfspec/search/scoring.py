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

from dataclasses import dataclass

import torch

from selfspec.draft.plan import SkipPlan
from selfspec.draft.skip import layer_skipper
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import DecodeConfig, autoregressive, forward_at


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
