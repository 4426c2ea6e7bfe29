"""The Optuna study over whole self-drafts (library side; the CLI is ``python -m selfspec.search``).

A trial suggests a draft (:class:`~selfspec.search.space.SearchSpace`); a draft
outside the skip budget is pruned unscored. The default objective simulates the
draft's greedy rounds on the calibration prompts (:mod:`selfspec.search.simulate`)
and prices them with the cost model (:mod:`selfspec.search.costs`); each trial
stores its round counts, so that a study resumed on another machine is re-scored
with that machine's cost model without running the model again
(:func:`top_drafts`). ``objective=wallclock`` times real runs instead.

A study lives in SQLite, a journal file or a database (:mod:`selfspec.search.workers`),
and any number of worker processes may run its trials at once. A study interrupted
by Ctrl-C or a kill resumes with every finished trial kept (a killed worker's running
trial is marked FAIL and run again). A study pins what makes its scores comparable
(model, calibration, space, objective) and refuses another.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from selfspec.search.costs import CostModel
from selfspec.search.rounds import RoundCounts
from selfspec.search.settings import SearchSettings
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import SearchSpace
from selfspec.search.workers import LIVENESS, Liveness, fail_dead_trials, heartbeat, open_storage, running_elsewhere


@dataclass
class Evaluation:
    value: float
    acceptance: float
    tokens_per_round: float
    counts: RoundCounts | None = None


class PredictedObjective:
    """Predicted speedup: the draft's simulated rounds on the calibration prompts, priced by the cost model.

    The prompts are simulated ``batch`` at a time (one batched draft forward per step of their
    rounds). ``report(step, value)``, when given, hears the running predicted speedup after each
    batch, ``step`` being the index of its last prompt (Optuna's pruner may then stop a clearly
    worse draft early by raising ``TrialPruned``).
    """

    def __init__(self, simulator: RoundSimulator, costs: CostModel, batch: int = SearchSettings.batch) -> None:
        self.simulator, self.costs, self.batch = simulator, costs, batch

    def __call__(self, spec: DraftSpec, report: Callable[[int, float], None] | None = None) -> Evaluation:
        path = self.simulator.draft_path(spec)
        counts = RoundCounts()
        for last, batch in self.simulator.batches(spec, path, self.batch):
            counts.add(batch)
            if report is not None and counts.tokens:
                report(last, self.costs.predicted_speedup(counts, spec))
        return Evaluation(self.costs.predicted_speedup(counts, spec), counts.acceptance, counts.tokens_per_round, counts)


def open_study(storage, study_name: str, model: str, sampler: str, seed: int,
               prune: bool = False, live: Liveness = LIVENESS) -> optuna.Study:
    """Create or resume a study in ``storage`` (a path, a URL, or an Optuna storage)."""
    if not isinstance(storage, optuna.storages.BaseStorage):
        storage = open_storage(storage)
    samplers = {
        # constant_liar: workers running at once do not all propose the draft the others are running
        "tpe": lambda: optuna.samplers.TPESampler(seed=seed, multivariate=True, constant_liar=True),
        "random": lambda: optuna.samplers.RandomSampler(seed=seed),
    }
    if sampler not in samplers:
        raise SelfSpecError(f"unknown sampler {sampler!r}; choose from {', '.join(samplers)}")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=study_name,
        storage=storage,
        sampler=samplers[sampler](),
        # after 10 trials, a draft whose running prediction falls under the median of earlier ones at the
        # same prompt (from the third prompt on) stops early
        pruner=optuna.pruners.MedianPruner(n_startup_trials=10, n_warmup_steps=2) if prune else optuna.pruners.NopPruner(),
        direction="maximize",
        load_if_exists=True,
    )
    pin_study_attr(study, "model", model,
                   f"study {study_name!r} was made for model {{recorded!r}}, not {model!r}; "
                   "choose another search.study_name")
    fail_dead_trials(study, live)  # left by a killed worker: they run again
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


def in_head_rescoring(space: SearchSpace, spec: DraftSpec) -> DraftSpec:
    """``spec`` with a quantized head rescored as ``space`` rescores it, where its own rescoring (0 in drafts written
    before the option) is not one the space holds: a warm start in the same draft otherwise (said on stderr)."""
    o, held = spec.options, space.dims.head_rescore
    if o.head_weights == "model" or not o.model_draft or o.head_rescore in held:
        return spec
    print(f"[selfspec] warm start {spec.describe()}: head_rescore={o.head_rescore} is not in search.space.head_rescore="
          f"{list(held)}; it starts with {held[0]}", file=sys.stderr)
    return spec.replace(options=replace(o, head_rescore=held[0]))


def warm_start_params(space: SearchSpace, drafts: list[DraftSpec]) -> list[dict]:
    """Each known draft as the trial parameters of ``space``; refuses a draft of another depth or outside it (drafts
    read from files take the space's head rescoring first, :func:`in_head_rescoring`)."""
    for spec in drafts:
        spec.plan.check_model(space.num_layers)
    return [space.params_of(spec) for spec in drafts]


def enqueue_warm_starts(study: optuna.Study, space: SearchSpace, drafts: list[DraftSpec]) -> int:
    """Enqueue known drafts to run first (only in a study with no trials yet)."""
    if study.get_trials(deepcopy=False):
        return 0
    for params in warm_start_params(space, drafts):
        study.enqueue_trial(params, skip_if_exists=True)
    return len(drafts)


def finished(study: optuna.Study) -> int:
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))


def run_search(
    study: optuna.Study,
    space: SearchSpace,
    objective: Callable[[DraftSpec], Evaluation],
    n_trials: int,
    model_name: str | None = None,
    callbacks: list | None = None,
    live: Liveness = LIVENESS,
) -> None:
    """Run trials until the study holds ``n_trials`` finished (complete or pruned) trials.

    Other workers may run trials of the same study at once: a trial starts only while
    the finished trials plus the live ones numbered before it stay under the budget, so
    the workers together never run more than ``n_trials``. A trial that finds the budget
    taken is closed as FAIL unrun (user attribute ``not_run``). While the rest of the
    budget is other workers' running trials, this worker waits for them: one whose worker
    dies (``live``) is marked failed, and a worker still here runs a trial in its place.
    A Ctrl-C ends the search once the trial under way is told (:func:`ctrl_c_between_trials`);
    a second one at once.
    """
    prunes = isinstance(objective, PredictedObjective)
    said = False
    with ctrl_c_between_trials() as check:
        while True:
            check()
            done = finished(study)
            if done >= n_trials:
                return
            if done + running_elsewhere(study, live=live) >= n_trials:
                if not said:
                    print(f"[selfspec] the budget's last trials run on other workers: waiting for them "
                          f"(study {study.study_name!r})", file=sys.stderr)
                    said = True
                time.sleep(min(2.0, live.heartbeat_s))
                fail_dead_trials(study, live)
                continue
            _one_trial(study, space, objective, model_name, prunes, n_trials, callbacks, live)


@contextmanager
def ctrl_c_between_trials() -> Iterator[Callable[[], None]]:
    """Hold a Ctrl-C until the next ``check()``: between trials, where no storage write is under way.

    A KeyboardInterrupt raised inside a storage commit can leave the SQLite file locked by
    a connection of this process, and the clean-up after it (giving the worker slot back)
    then waits for that lock. A second Ctrl-C interrupts at once. Outside the main thread,
    or when SIGINT has a handler of its own, nothing changes.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield lambda: None
        return
    pending: list[int] = []

    def hold(signum, frame) -> None:
        if pending:
            raise KeyboardInterrupt
        pending.append(signum)

    def check() -> None:
        if pending:
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, hold)
    try:
        yield check
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _one_trial(study: optuna.Study, space: SearchSpace, objective, model_name: str | None, prunes: bool,
               n_trials: int, callbacks: list | None, live: Liveness) -> bool:
    """Ask, run and tell one trial; False when the budget was taken by other workers meanwhile."""
    trial = study.ask()
    if finished(study) + running_elsewhere(study, below=trial.number, live=live) >= n_trials:
        trial.set_user_attr("not_run", "the trial budget was taken by other workers")
        study.tell(trial, state=TrialState.FAIL)
        return False
    try:
        with heartbeat(trial, live):
            value, state = _run_trial(trial, space, objective, model_name, prunes), TrialState.COMPLETE
    except optuna.TrialPruned:
        value, state = None, TrialState.PRUNED
    except UpdateFinishedTrialError:  # failed by another worker, which heard no heartbeat for stale_after_s (a stall)
        print(f"[selfspec] trial {trial.number} was taken for dead by another worker (no heartbeat for "
              f"{live.stale_after_s:g} s) and marked failed; its result is dropped", file=sys.stderr)
        return True
    except BaseException:  # a second Ctrl-C, or an error: the trial runs again on resume
        study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
        raise
    frozen = study.tell(trial, value, state=state, skip_if_finished=True)
    for callback in callbacks or []:
        callback(study, frozen)
    fail_dead_trials(study, live)
    return True


def _run_trial(trial: optuna.Trial, space: SearchSpace, objective, model_name: str | None, prunes: bool) -> float:
    spec = space.suggest(trial, model_name)
    trial.set_user_attr("n_skipped", spec.plan.n_skipped)
    trial.set_user_attr("k", spec.k)
    if not space.within(spec.plan):
        raise optuna.TrialPruned(f"{spec.plan.n_skipped} sublayers skipped is outside the budget")
    ev = objective(spec, report=lambda step, value: _report(trial, step, value)) if prunes else objective(spec)
    trial.set_user_attr("predicted_acceptance", ev.acceptance)
    trial.set_user_attr("tokens_per_round", ev.tokens_per_round)
    if ev.counts is not None:
        trial.set_user_attr("counts", ev.counts.to_dict())
    return ev.value


def _report(trial: optuna.Trial, step: int, value: float) -> None:
    trial.report(value, step)
    if trial.should_prune():
        raise optuna.TrialPruned(f"predicted {value:.3f}x after {step + 1} prompts: below the median of earlier trials")


@dataclass
class Ranked:
    spec: DraftSpec
    trial: optuna.trial.FrozenTrial
    value: float  # the trial's predicted speedup, re-scored with ``costs`` when given
    twins: list[DraftSpec] = field(default_factory=list)  # lower-ranked drafts predicted exactly alike (see top_drafts)


def top_drafts(study: optuna.Study, space: SearchSpace, n: int, model: str | None = None,
               costs: CostModel | None = None) -> list[Ranked]:
    """The ``n`` best distinct drafts; with ``costs``, each trial is re-scored from its stored round counts.

    With ``costs``, drafts with the same round counts over the calibration prompts and the same priced
    draft, verify and plain time are twins the search cannot tell apart (e.g. copy drafts whose n-gram
    sizes found the same matches): the best-ranked one stands for them and lists the others in ``twins``,
    so a re-timing spends its runs on drafts that differ, not on noise between twins.
    """
    ranked = []  # (draft, what the search knows of its behaviour: None without costs or stored counts)
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        if t.value is None:
            continue
        spec = space.spec_of(t.params, model)
        value, behaviour = t.value, None
        if costs is not None and "counts" in t.user_attrs:
            counts = RoundCounts.from_dict(t.user_attrs["counts"])
            value = costs.predicted_speedup(counts, spec)
            parts = costs.breakdown(counts, spec)
            behaviour = json.dumps(t.user_attrs["counts"], sort_keys=True), tuple(round(v, 12) for v in parts.values())
        ranked.append((Ranked(spec, t, value), behaviour))
    ranked.sort(key=lambda rb: rb[0].value, reverse=True)
    seen, out, standing = set(), [], {}
    for r, behaviour in ranked:
        if r.spec.key in seen:
            continue
        seen.add(r.spec.key)
        if behaviour is not None and behaviour in standing:
            standing[behaviour].twins.append(r.spec)
            continue
        if len(out) < n:
            out.append(r)
            if behaviour is not None:
                standing[behaviour] = r
    return out
