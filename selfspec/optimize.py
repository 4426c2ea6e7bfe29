"""The Optuna search for a skip plan (library side; the CLI is ``selfspec.search``).

Search space: one boolean per attention sublayer and one per MLP sublayer
(``attn_i`` / ``mlp_i``), minus protected first/last layers. A trial whose
plan breaks the budget (min/max sublayers skipped) is pruned without being
scored. The objective is the cost model's predicted speedup (default) or the
measured wall-clock speedup of real self-speculative runs.

Studies live in SQLite: a study interrupted by Ctrl-C or a kill resumes with
every finished trial kept (trials left RUNNING by a kill are marked FAIL and
re-run). A study remembers the model it was made for and refuses another.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from .calibrate import AgreementScorer, CostModel
from .decoding import DecodeConfig, autoregressive, self_speculative
from .errors import SelfSpecError
from .plan import SkipPlan


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


@dataclass
class Evaluation:
    value: float
    k: int
    agreement: float
    predicted_acceptance: float


class PredictedObjective:
    """Predicted speedup from agreement on calibration prompts and the measured cost model."""

    def __init__(self, scorer: AgreementScorer, costs: CostModel) -> None:
        self.scorer, self.costs = scorer, costs

    def __call__(self, plan: SkipPlan) -> Evaluation:
        score = self.scorer.score(plan)
        value, k = self.costs.predicted_speedup(plan, score)
        return Evaluation(value, k, score.agreement, score.acceptance(k))


class WallclockObjective:
    """Measured speedup of real self-speculative runs on the calibration prompts (noisy, slow)."""

    def __init__(self, model, prompts, eos_ids, max_new_tokens: int, k: int) -> None:
        self.model, self.prompts, self.eos = model, prompts, eos_ids
        self.cfg = DecodeConfig(max_new_tokens=max_new_tokens, k=k, fallback=False)
        self.ar_tps, _ = measure_tokens_per_s(model, prompts, None, self.cfg, eos_ids)

    def __call__(self, plan: SkipPlan) -> Evaluation:
        tps, acc = measure_tokens_per_s(self.model, self.prompts, plan, self.cfg, self.eos)
        return Evaluation(tps / self.ar_tps, self.cfg.k, float("nan"), acc)


def measure_tokens_per_s(model, prompts, plan, cfg, eos_ids) -> tuple[float, float]:
    """Total new tokens / total time over ``prompts``, and accepted / drafted (plan None = autoregressive, nan)."""
    tokens = seconds = drafted = accepted = 0
    for p in prompts:
        g = autoregressive(model, p, cfg, eos_ids) if plan is None else self_speculative(model, p, plan, cfg, eos_ids)
        tokens += g.stats.new_tokens
        seconds += g.stats.total_time
        drafted += g.stats.drafted
        accepted += g.stats.accepted
    tps = tokens / seconds
    return tps, accepted / drafted if drafted else float("nan")


def open_study(storage_path: Path, study_name: str, model: str, sampler: str, seed: int) -> optuna.Study:
    """Create or resume a study stored in SQLite at ``storage_path``."""
    storage_path = Path(storage_path)
    try:
        storage_path.parent.mkdir(parents=True, exist_ok=True)
        probe = storage_path.parent / f".{storage_path.name}.probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SelfSpecError(f"cannot write the study storage at {storage_path}: {e.strerror or e}") from None
    samplers = {
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    if sampler not in samplers:
        raise SelfSpecError(f"unknown sampler {sampler!r}; choose from {', '.join(samplers)}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(f"sqlite:///{storage_path}")
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=samplers[sampler](),
        direction="maximize",
        load_if_exists=True,
    )
    pin_study_attr(study, "model", model,
                   f"study {study_name!r} in {storage_path} was made for model {{recorded!r}}, not {model!r}; "
                   "choose another search.study_name")
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)  # left by a killed run
    return study


def pin_study_attr(study: optuna.Study, name: str, value, message: str) -> None:
    """Record ``value`` under ``name`` on a new study; on a resumed one, refuse a different value.

    ``message`` may use ``{recorded}`` for the value the study holds.
    """
    recorded = study.user_attrs.get(name)
    if recorded is None:
        study.set_user_attr(name, value)
    elif recorded != value:
        raise SelfSpecError(message.format(recorded=recorded))


def enqueue_warm_starts(study: optuna.Study, space: SearchSpace, plans: list[SkipPlan]) -> int:
    """Enqueue known plans to run first (only in a study with no trials yet)."""
    if study.get_trials(deepcopy=False):
        return 0
    for plan in plans:
        plan.check_model(space.num_layers)
        study.enqueue_trial(space.params_of(plan), skip_if_exists=True)
    return len(plans)


def finished(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run_search(
    study: optuna.Study,
    space: SearchSpace,
    objective: Callable[[SkipPlan], Evaluation],
    n_trials: int,
    model_name: str | None = None,
    callbacks: list | None = None,
) -> None:
    """Run trials until the study holds ``n_trials`` finished (complete or pruned) trials."""

    def trial_fn(trial: optuna.Trial) -> float:
        plan = space.suggest(trial, model_name)
        trial.set_user_attr("n_skipped", plan.n_skipped)
        if not space.within(plan):
            raise optuna.TrialPruned(f"{plan.n_skipped} sublayers skipped is outside the budget")
        ev = objective(plan)
        trial.set_user_attr("k", ev.k)
        trial.set_user_attr("agreement", ev.agreement)
        trial.set_user_attr("predicted_acceptance", ev.predicted_acceptance)
        return ev.value

    remaining = n_trials - finished(study)
    if remaining > 0:
        study.optimize(trial_fn, n_trials=remaining, callbacks=callbacks or [], catch=())


def top_plans(study: optuna.Study, space: SearchSpace, n: int, model: str | None = None) -> list[tuple[SkipPlan, optuna.trial.FrozenTrial]]:
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    done.sort(key=lambda t: t.value, reverse=True)
    seen, out = set(), []
    for t in done:
        plan = space.plan_of(t.params, model)
        key = (plan.attn, plan.mlp)
        if key not in seen:
            seen.add(key)
            out.append((plan, t))
        if len(out) == n:
            break
    return out


def retime(model, prompts, plans_k: list[tuple[SkipPlan, int]], eos_ids, max_new_tokens: int, reps: int) -> list[dict]:
    """Real runs: AR and each (plan, k), interleaved per repetition after a warm-up; medians."""
    warm = DecodeConfig(max_new_tokens=4)
    autoregressive(model, prompts[0], warm, eos_ids)
    ar_times: list[float] = []
    results = [{"times": [], "acceptance": []} for _ in plans_k]
    for _ in range(reps):
        cfg = DecodeConfig(max_new_tokens=max_new_tokens, fallback=False)
        ar_times.append(1.0 / measure_tokens_per_s(model, prompts, None, cfg, eos_ids)[0])
        for (plan, k), res in zip(plans_k, results):
            kcfg = DecodeConfig(max_new_tokens=max_new_tokens, k=k, fallback=False)
            tps, acc = measure_tokens_per_s(model, prompts, plan, kcfg, eos_ids)
            res["times"].append(1.0 / tps)
            res["acceptance"].append(acc)
    ar = statistics.median(ar_times)
    return [
        {
            "speedup": ar / statistics.median(r["times"]),
            "acceptance": statistics.median(r["acceptance"]),
            "ar_tokens_per_s": 1.0 / ar,
            "tokens_per_s": 1.0 / statistics.median(r["times"]),
        }
        for r in results
    ]
