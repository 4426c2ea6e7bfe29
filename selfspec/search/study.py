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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import TrialState

from selfspec.draft.plan import SkipPlan
from selfspec.errors import SelfSpecError
from selfspec.search.costs import CostModel
from selfspec.search.scoring import AgreementScorer
from selfspec.search.space import SearchSpace


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


def top_plans(study: optuna.Study, space: SearchSpace, n: int,
              model: str | None = None) -> list[tuple[SkipPlan, optuna.trial.FrozenTrial]]:
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
