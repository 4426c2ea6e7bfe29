"""The search space: one boolean per searchable attention and MLP sublayer, and the budget.

Parameters are ``attn_i`` / ``mlp_i`` for the searchable layers (first and last
protected by default); a plan outside ``min_skipped..max_skipped`` is pruned
unscored by the study.
"""

from __future__ import annotations

from dataclasses import dataclass

import optuna

from selfspec.draft.plan import SkipPlan
from selfspec.errors import SelfSpecError


@dataclass(frozen=True)
class SearchSpace:
    num_layers: int
    min_skipped: int = 1
    max_skipped: int | None = None
    protect_first_last: bool = True

    @property
    def searchable(self) -> list[int]:
        lo, hi = (1, self.num_layers - 1) if self.protect_first_last else (0, self.num_layers)
        return list(range(lo, hi))

    @property
    def upper(self) -> int:
        n = 2 * len(self.searchable)
        cap = 2 * self.num_layers - 1  # a plan must keep one sublayer
        return min(n, cap, self.max_skipped if self.max_skipped is not None else n)

    def check(self) -> None:
        if self.min_skipped < 0 or (self.max_skipped is not None and self.max_skipped < 0):
            raise SelfSpecError("search budget bounds must be >= 0")
        if not self.searchable:
            raise SelfSpecError("no layer is searchable: the model has too few layers to protect first and last")
        if self.upper < max(self.min_skipped, 1):
            raise SelfSpecError(
                f"the search budget allows no plan: min_skipped={self.min_skipped}, "
                f"max_skipped={self.max_skipped}, {2 * len(self.searchable)} searchable sublayers"
            )

    def params_of(self, plan: SkipPlan) -> dict[str, int]:
        return {
            **{f"attn_{i}": int(i in plan.attn) for i in self.searchable},
            **{f"mlp_{i}": int(i in plan.mlp) for i in self.searchable},
        }

    def plan_of(self, params: dict, model: str | None = None) -> SkipPlan:
        attn = tuple(i for i in self.searchable if params.get(f"attn_{i}"))
        mlp = tuple(i for i in self.searchable if params.get(f"mlp_{i}"))
        return SkipPlan(self.num_layers, attn=attn, mlp=mlp, model=model)

    def suggest(self, trial: optuna.Trial, model: str | None) -> SkipPlan:
        params = {}
        for kind in ("attn", "mlp"):
            for i in self.searchable:
                params[f"{kind}_{i}"] = trial.suggest_categorical(f"{kind}_{i}", [0, 1])
        return self.plan_of(params, model)

    def within(self, plan: SkipPlan) -> bool:
        return max(self.min_skipped, 1) <= plan.n_skipped <= self.upper
