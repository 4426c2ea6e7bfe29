"""A whole plan search, start to finish, from typed settings (no Hydra, no W&B here).

Steps: encode prompts -> calibrate (full-model continuations and the cost
model, computed once and stored beside the study so a resumed search scores
trials identically) -> Optuna trials -> re-time the top plans with real
self-speculative runs -> report on held-out prompts -> write the plan JSON.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from selfspec.assets.data import PromptSet
from selfspec.assets.models import LoadedModel, encode_prompt
from selfspec.draft.plan import SkipPlan
from selfspec.errors import SelfSpecError
from selfspec.provenance import provenance
from selfspec.search.costs import CostModel, measure_costs
from selfspec.search.retime import WallclockObjective, retime
from selfspec.search.scoring import AgreementScorer
from selfspec.search.space import SearchSpace
from selfspec.search.study import (
    PredictedObjective,
    enqueue_warm_starts,
    finished,
    open_study,
    pin_study_attr,
    run_search,
    top_plans,
)


@dataclass(frozen=True)
class RetimeSettings:
    top_n: int = 3
    reps: int = 3
    prompts: int = 2
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        _at_least(self, 1, "retime", "top_n", "reps", "prompts", "max_new_tokens")


@dataclass(frozen=True)
class HeldoutSettings:
    prompts: int = 4
    max_new_tokens: int = 32
    reps: int = 2

    def __post_init__(self) -> None:
        _at_least(self, 0, "heldout", "prompts")
        _at_least(self, 1, "heldout", "max_new_tokens", "reps")


def _at_least(settings, lowest: int, where: str, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise SelfSpecError(f"{where}.{name} must be an integer >= {lowest}, got {value!r}")


@dataclass(frozen=True)
class SearchSettings:
    n_trials: int = 100
    sampler: str = "tpe"
    objective: str = "predicted"
    k_max: int = 8
    calibration_tokens: int = 24
    min_skipped: int = 1
    max_skipped: int | None = None
    protect_first_last: bool = True
    warm_start: tuple[str, ...] = ()
    storage: str = "results/optuna/search.db"
    study_name: str = "search"
    cost_reps: int = 7
    seed: int = 0
    plans_dir: str = "results/plans"
    retime: RetimeSettings = field(default_factory=RetimeSettings)
    heldout: HeldoutSettings = field(default_factory=HeldoutSettings)

    def __post_init__(self) -> None:
        if self.objective not in ("predicted", "wallclock"):
            raise SelfSpecError(f"unknown objective {self.objective!r}; choose predicted or wallclock")
        _at_least(self, 1, "search", "n_trials", "k_max", "cost_reps")
        _at_least(self, 2, "search", "calibration_tokens")


@dataclass
class SearchReport:
    plan: SkipPlan
    k: int
    predicted_speedup: float
    calibration_acceptance_predicted: float
    calibration_acceptance_measured: float
    heldout_acceptance_predicted: float
    heldout_acceptance_measured: float
    measured_speedup_calibration: float
    measured_speedup_heldout: float
    trials: int
    search_seconds: float
    plan_path: str
    candidates: list = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plan"] = self.plan.to_dict()
        return d


def _calibration(study: optuna.Study, lm: LoadedModel, prompts: list[list[int]], s: SearchSettings, path: Path):
    """Continuations and costs: loaded from ``path`` when it matches, else computed and saved."""
    key = {"model": lm.name, "prompts": prompts, "n_tokens": s.calibration_tokens, "k_max": s.k_max}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    pin_study_attr(study, "calibration", digest,
                   f"study {study.study_name!r} was scored with other calibration prompts or settings; "
                   "its trials would not compare: choose another search.study_name")
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            scorer = AgreementScorer(lm.model, prompts, s.calibration_tokens, lm.eos_ids, s.k_max,
                                     continuations=saved["continuations"])
            return scorer, CostModel.from_dict(saved["costs"])
    print("[selfspec] calibrating: full-model continuations and the cost model (once per study)", file=sys.stderr)
    scorer = AgreementScorer(lm.model, prompts, s.calibration_tokens, lm.eos_ids, s.k_max)
    costs = measure_costs(lm.model, prompts[0] + scorer.continuations[0], s.k_max, s.cost_reps)
    path.write_text(json.dumps({"key": key, "continuations": scorer.continuations, "costs": costs.to_dict()}))
    return scorer, costs


class _Progress:
    """Optuna callback: a tqdm bar with the best predicted speedup and its acceptance."""

    def __init__(self, total: int, done: int) -> None:
        self.bar = tqdm(total=total, initial=done, desc="search", unit="trial", file=sys.stderr)

    def __call__(self, study: optuna.Study, trial) -> None:
        self.bar.update(1)
        try:
            best = study.best_trial
            acc = best.user_attrs.get("predicted_acceptance", float("nan"))
            self.bar.set_postfix(best=f"{best.value:.3f}x", acc=f"{acc:.2f}",
                                 k=best.user_attrs.get("k"))
        except ValueError:
            pass

    def close(self) -> None:
        self.bar.close()


def search(
    lm: LoadedModel,
    prompt_set: PromptSet,
    s: SearchSettings,
    on_trial: Callable | None = None,
    extra_provenance: dict | None = None,
) -> SearchReport:
    t_start = time.perf_counter()
    calib_ids = [encode_prompt(lm.tokenizer, p) for p in prompt_set.calibration]
    held_ids = [encode_prompt(lm.tokenizer, p) for p in prompt_set.heldout[: s.heldout.prompts]]
    space = SearchSpace(lm.num_layers, s.min_skipped, s.max_skipped, s.protect_first_last)
    space.check()
    storage = Path(s.storage)
    study = open_study(storage, s.study_name, lm.name, s.sampler, s.seed)
    warm = [SkipPlan.load(p) for p in s.warm_start]
    enqueue_warm_starts(study, space, warm)
    scorer, costs = _calibration(study, lm, calib_ids, s, storage.with_name(storage.stem + ".calibration.json"))
    if s.objective == "predicted":
        objective = PredictedObjective(scorer, costs)
    else:
        objective = WallclockObjective(lm.model, calib_ids[: s.retime.prompts], lm.eos_ids,
                                       s.retime.max_new_tokens, min(4, s.k_max))
    progress = _Progress(s.n_trials, finished(study))
    callbacks = [progress] + ([on_trial] if on_trial else [])
    try:
        run_search(study, space, objective, s.n_trials, lm.name, callbacks)
    finally:
        progress.close()
    tops = top_plans(study, space, s.retime.top_n, lm.name)
    if not tops:
        raise SelfSpecError("no trial finished within the budget; widen min_skipped/max_skipped or run more trials")
    # re-time the best few with real runs, then pick by measured speedup
    plans_k = [(plan, t.user_attrs.get("k", 1)) for plan, t in tops]
    timed = retime(lm.model, calib_ids[: s.retime.prompts], plans_k, lm.eos_ids, s.retime.max_new_tokens, s.retime.reps)
    candidates = [
        {"plan": p.describe(), "k": k, "predicted_speedup": t.value,
         "predicted_acceptance": t.user_attrs.get("predicted_acceptance"),
         "measured_speedup": m["speedup"], "measured_acceptance": m["acceptance"]}
        for (p, t), (_, k), m in zip(tops, plans_k, timed)
    ]
    best_i = max(range(len(tops)), key=lambda i: timed[i]["speedup"])
    plan, trial = tops[best_i]
    k = plans_k[best_i][1]
    # held-out: predicted (agreement) and measured acceptance and speedup
    if held_ids:
        held_scorer = AgreementScorer(lm.model, held_ids, s.heldout.max_new_tokens, lm.eos_ids, s.k_max)
        held_pred = held_scorer.score(plan).acceptance(k)
        held = retime(lm.model, held_ids, [(plan, k)], lm.eos_ids, s.heldout.max_new_tokens, s.heldout.reps)[0]
    else:
        held_pred, held = float("nan"), {"acceptance": float("nan"), "speedup": float("nan")}
    report = SearchReport(
        plan=plan, k=k, predicted_speedup=trial.value,
        calibration_acceptance_predicted=trial.user_attrs.get("predicted_acceptance", float("nan")),
        calibration_acceptance_measured=timed[best_i]["acceptance"],
        heldout_acceptance_predicted=held_pred, heldout_acceptance_measured=held["acceptance"],
        measured_speedup_calibration=timed[best_i]["speedup"], measured_speedup_heldout=held["speedup"],
        trials=finished(study), search_seconds=time.perf_counter() - t_start, plan_path="", candidates=candidates,
    )
    prov = provenance({"model": lm.name, "dataset": prompt_set.name, "dtype": lm.info.get("dtype"),
                       "study": s.study_name, "storage": str(storage), "objective": s.objective,
                       "k": k, "predicted_speedup": trial.value,
                       "acceptance": {"calibration_predicted": report.calibration_acceptance_predicted,
                                      "calibration_measured": report.calibration_acceptance_measured,
                                      "heldout_predicted": held_pred, "heldout_measured": held["acceptance"]},
                       "measured_speedup": {"calibration": report.measured_speedup_calibration,
                                            "heldout": report.measured_speedup_heldout},
                       "cost_model": costs.to_dict(), **(extra_provenance or {})})
    final = SkipPlan(plan.num_layers, plan.attn, plan.mlp, model=lm.name, provenance=prov)
    path = final.save(Path(s.plans_dir) / f"{s.study_name}.json")
    report.plan, report.plan_path = final, str(path)
    return report


def format_report(r: SearchReport) -> str:
    lines = [
        "",
        f"best plan   {r.plan.describe()}, k={r.k}",
        f"  attention layers skipped: {list(r.plan.attn)}",
        f"  MLP layers skipped:       {list(r.plan.mlp)}",
        f"acceptance  calibration: predicted {r.calibration_acceptance_predicted:.3f}, "
        f"measured {r.calibration_acceptance_measured:.3f}",
        f"            held-out:    predicted {r.heldout_acceptance_predicted:.3f}, measured {r.heldout_acceptance_measured:.3f}",
        f"speedup     predicted {r.predicted_speedup:.3f}x; measured {r.measured_speedup_calibration:.3f}x (calibration), "
        f"{r.measured_speedup_heldout:.3f}x (held-out)",
        f"trials      {r.trials} in {r.search_seconds:.0f} s",
        "re-timed candidates:",
    ]
    for c in r.candidates:
        lines.append(f"  {c['plan']}, k={c['k']}: predicted {c['predicted_speedup']:.3f}x, measured {c['measured_speedup']:.3f}x")
    lines.append(f"plan written to {r.plan_path}")
    if r.measured_speedup_heldout < 1.0:
        lines.append("note: no real speedup on held-out prompts for this model on this machine (see README).")
    return "\n".join(lines)
