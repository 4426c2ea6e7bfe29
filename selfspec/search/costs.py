"""The cost model: seconds of the forwards a draft round is made of, measured on this machine.

:class:`CostModel` holds the time of one full-depth one-token forward, what each
attention and each MLP sublayer adds to it, and the time of a verify forward
over ``k+1`` tokens. The predicted speedup of a plan at ``k`` is
``tokens_per_round(k) * t_full / (k * t_draft + t_verify(k+1))``.
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch

from selfspec.draft.packed import packed_weights
from selfspec.draft.plan import SkipPlan
from selfspec.draft.skip import layer_skipper
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.engine.stats import Clock
from selfspec.search.scoring import PlanScore


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
    def from_dict(cls, d: dict) -> CostModel:
        return cls(d["t_full"], d["t_attn"], d["t_mlp"], {int(k): v for k, v in d["t_verify"].items()}, d["num_layers"])


def measure_costs(model, context: list[int], k_max: int = 8, reps: int = 7, packed: bool = True) -> CostModel:
    """Time the forwards the cost model needs (median of ``reps`` after one warm-up each).

    ``packed``: time them as decoding runs them by default, on the packed weights
    (:mod:`selfspec.draft.packed`).
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
