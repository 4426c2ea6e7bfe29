"""A whole draft search, start to finish, from typed settings (no Hydra, no W&B here).

Steps: encode prompts -> calibrate (the full model's continuations, pinned to
the study; the cost model, re-measured whenever the machine differs from the
one that measured it; both stored in the study, computed by one worker) ->
Optuna trials (each draft's rounds simulated exactly and priced; any number of
workers at once) -> re-time the top drafts with real self-speculative runs ->
report on held-out prompts, with an ablation of the found draft -> write the
draft file (by the last worker to finish).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from selfspec.assets.data import PromptSet
from selfspec.assets.models import LoadedModel, encode_prompt, load_model
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.errors import SelfSpecError
from selfspec.locks import check_writable
from selfspec.model.plan import SkipPlan
from selfspec.provenance import machine_fingerprint, provenance
from selfspec.search.costs import COST_MODEL_VERSION, CostModel, head_format, measure_costs, weight_format
from selfspec.search.retime import WallclockObjective, retime
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import DraftDims, SearchSpace
from selfspec.search.study import (
    PredictedObjective,
    enqueue_warm_starts,
    finished,
    open_study,
    pin_study_attr,
    run_search,
    top_drafts,
)
from selfspec.search.workers import (
    WORKER,
    claimed_once,
    fail_dead_trials,
    open_storage,
    release,
    running_elsewhere,
    storage_file,
    try_claim,
    worker_slot,
)

STUDY_FORMAT = "selfspec.study/2"  # trials are whole drafts with their round counts
CALIBRATION_ATTR = "calibration_data"  # the study's calibration: continuations and the cost model


@dataclass(frozen=True)
class RetimeSettings:
    top_n: int = 3
    reps: int = 2
    prompts: int = 4
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        _at_least(self, 1, "retime", "top_n", "reps", "prompts", "max_new_tokens")


@dataclass(frozen=True)
class HeldoutSettings:
    prompts: int = 4
    max_new_tokens: int = 128
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
    calibration_tokens: int = 24
    min_skipped: int = 0
    max_skipped: int | None = None
    protect_first_last: bool = True
    space: DraftDims = field(default_factory=DraftDims)
    warm_start: tuple[str, ...] = ()
    anchors: bool = True
    storage: str = "outputs/optuna/search.db"
    study_name: str = "search"
    cost_reps: int = 7
    batch: int = 4
    prune: bool = True
    ablation: bool = True
    seed: int = 0
    plans_dir: str = "outputs/plans"
    retime: RetimeSettings = field(default_factory=RetimeSettings)
    heldout: HeldoutSettings = field(default_factory=HeldoutSettings)
    time_target_s: float | None = 600.0  # the report says where the time went when a run takes longer (None: no check)
    fit_target: bool = True  # trim the final stages' repetitions when that keeps the run within time_target_s

    def __post_init__(self) -> None:
        if self.objective not in ("predicted", "wallclock"):
            raise SelfSpecError(f"unknown objective {self.objective!r}; choose predicted or wallclock")
        _at_least(self, 1, "search", "n_trials", "cost_reps", "batch")
        _at_least(self, 2, "search", "calibration_tokens")


@dataclass
class SearchReport:
    draft: DraftSpec
    predicted_speedup: float
    calibration: dict  # acceptance / tokens per round / speedup, predicted and measured
    heldout: dict
    trials: int
    search_seconds: float
    plan_path: str
    cost_model_note: str
    candidates: list = field(default_factory=list)
    ablation: list = field(default_factory=list)
    stages: dict = field(default_factory=dict)  # seconds of each stage of the search, in order
    draft_chunks: dict = field(default_factory=dict)  # this process: draft chunks run / answered from memory
    setup_seconds: float = 0.0  # before the search's clock: fetching and loading the model and prompts (the entry point's)
    time_target_s: float | None = None  # SearchSettings.time_target_s
    plain_step_s: float | None = None  # the cost model's one-token full-model forward on this machine
    trimmed: list = field(default_factory=list)  # what the final stages left out to meet time_target_s (fit_target)
    final_stages_s: list | None = None  # the final stages' estimated seconds as run, and the seconds left for them
    loop_overheads: dict = field(default_factory=dict)  # the cost model's overheads (CostModel.overhead), seconds

    def to_dict(self) -> dict:
        d = asdict(self)
        d["draft"] = self.draft.to_dict()
        return d


class _Progress:
    """Optuna callback: a tqdm bar of the study's finished trials, with the best predicted speedup and its acceptance."""

    def __init__(self, total: int, done: int) -> None:
        self.bar = tqdm(total=total, initial=done, desc="search", unit="trial", file=sys.stderr)

    def __call__(self, study: optuna.Study, trial) -> None:
        self.bar.update(max(1, finished(study) - self.bar.n))  # the study's count: other workers' trials too
        try:
            best = study.best_trial
            acc = best.user_attrs.get("predicted_acceptance", float("nan"))
            self.bar.set_postfix(best=f"{best.value:.3f}x", acc=f"{acc:.2f}", k=best.user_attrs.get("k"))
        except ValueError:
            pass

    def close(self) -> None:
        self.bar.close()


def ablation_variants(spec: DraftSpec) -> list[tuple[str, DraftSpec]]:
    """The found draft, and the same draft without each lever it uses."""
    o, plan = spec.options, spec.plan
    out = [("found draft", spec)]
    if plan.n_skipped:
        out.append(("without skipping", skip_free(spec)))
    if o.weights != "model":
        out.append(("without low precision", spec.replace(options=_options(o, weights="model"))))
    if o.head_tokens:
        out.append(("without the cut head", spec.replace(options=_options(o, head_tokens=0))))
    if o.head_weights != "model":
        out.append(("without the quantized head", spec.replace(options=_options(o, head_weights="model"))))
    if not o.model_draft:  # copy only: without copying it would be plain decoding, so add the model draft instead
        out.append(("with model drafts", spec.replace(options=_options(o, model_draft=True))))
    elif o.ngram:
        out.append(("without copy drafting", spec.replace(options=_options(o, **_NO_COPY))))
    if o.min_ngram:
        out.append(("without shorter copies", spec.replace(options=_options(o, min_ngram=0))))
    if o.copy_per_match:
        out.append(("copies not cut by match length", spec.replace(options=_options(o, copy_per_match=0))))
    if o.tree:
        out.append(("a chain (no draft tree)", spec.replace(options=_options(o, copy_candidates=1, branch_below=0.0))))
    if spec.adaptive:
        out.append(("fixed k (no adaptive exit)", spec.replace(adaptive=False, threshold=0.5)))
    return out


def cumulative_variants(spec: DraftSpec, papers: DraftSpec | None = None) -> list[tuple[str, DraftSpec]]:
    """The paper-style ablation: the skip plan alone (the layer-skip papers' draft, at the found k), then
    each lever of the found draft added in turn (the adaptive exit last: it makes the searched draft),
    then the searched draft without skipping. A lever the draft does not use adds no row.

    ``papers``: the draft of a pure layer-skip search (model weights, full head, no copies), the papers'
    method as this search finds it. Its row replaces the skip plan alone, and one more row runs the searched
    draft's options on its skip plan. A searched draft that skips nothing needs it: its skip plan alone is the
    model drafting for itself, which saves nothing.
    """
    if papers is not None and papers.plan.num_layers != spec.plan.num_layers:
        raise ValueError(f"the layer-skip draft has {papers.plan.num_layers} layers, the searched one "
                         f"{spec.plan.num_layers}: they are drafts of different models")
    o = spec.options
    plain = DraftSpec(spec.plan, DraftOptions(), k=spec.k)
    steps = [("skip_only", plain if papers is None else papers),
             ("plus_low_precision", plain.replace(options=_options(plain.options, weights=o.weights,
                                                                    group_size=o.group_size))),
             ("plus_cut_head", plain.replace(options=_options(o, **_NO_COPY, copy_candidates=1, branch_below=0.0))),
             ("plus_copy", plain.replace(options=_options(o, copy_candidates=1, branch_below=0.0))),
             ("plus_tree", plain.replace(options=o))]
    out, seen = [], {spec.key}
    for name, variant in steps:
        if variant.key not in seen:
            seen.add(variant.key)
            out.append((name, variant))
    out.append(("searched", spec))
    if spec.plan.n_skipped:
        out.append(("searched_no_skip", skip_free(spec)))
    if papers is not None and (papers.plan.attn, papers.plan.mlp) != (spec.plan.attn, spec.plan.mlp):
        out.append(("searched_papers_skip", spec.replace(plan=papers.plan)))
    return out


def skip_free(spec: DraftSpec) -> DraftSpec:
    """The same draft with no sublayer skipped: its options and length policy alone."""
    return spec.replace(plan=SkipPlan(spec.plan.num_layers, model=spec.plan.model))


# the options a draft with no copy drafting sets (the copy settings need an n-gram size)
_NO_COPY = {"ngram": 0, "copy_tokens": 0, "min_ngram": 0, "copy_per_match": 0, "copy_fallback": 0, "model_draft": True}


def _options(o: DraftOptions, **changes) -> DraftOptions:
    return DraftOptions(**{**asdict(o), **changes})


def spread(n_items: int, n: int) -> list[int]:
    """``n`` indices spread evenly over ``n_items`` items (all of them when ``n >= n_items``).

    The search re-times and checks held out on a few prompts: spread over a prompt list made of
    blocks (the ``tasks`` mix: each set's rows in turn), they sample every block, not the first one.
    """
    if n >= n_items:
        return list(range(n_items))
    return [i * n_items // n for i in range(n)]


@dataclass(frozen=True)
class FinalStages:
    """The repetitions the held-out check and the ablation run (0: the ablation does not run), and what was
    left out of the settings to meet the time target."""
    heldout_reps: int
    ablation_reps: int
    trimmed: tuple[str, ...] = ()
    estimate_s: float | None = None  # their estimated seconds, as run (None: no target to fit)


def fit_final_stages(s: SearchSettings, left_s: float | None, run_s: float, n_held: int, n_timed: int,
                     n_variants: int, margin: float = 1.1) -> FinalStages:
    """The final stages as set, or with fewer repetitions where ``left_s`` (seconds left before
    ``s.time_target_s``; None: no target) would not hold them and fewer would (``s.fit_target``).

    Estimated from ``run_s``, one re-timing run's seconds (``s.retime.max_new_tokens`` tokens): the held-out
    check runs AR and the draft ``heldout.reps`` times on ``n_held`` prompts of ``heldout.max_new_tokens``
    tokens, the ablation AR and ``n_variants`` drafts on the ``n_timed`` re-timing prompts. Trimmed in order:
    the ablation to one repetition, the held-out check to one, then no ablation; the held-out check always runs.
    When even that would not fit, everything runs as set (the report's time note then says why). ``margin``:
    the estimate times this must fit (the main job's held-out check ran ~15% over it, docs/log.md).
    """
    held, ablation = s.heldout.reps, (s.retime.reps if s.ablation and n_variants else 0)
    per_held = 2 * n_held * run_s * s.heldout.max_new_tokens / s.retime.max_new_tokens
    per_ablation = (1 + n_variants) * n_timed * run_s

    def estimate(h: int, a: int) -> float:
        return margin * (h * per_held + a * per_ablation)

    def fits(h: int, a: int) -> bool:
        return estimate(h, a) <= left_s

    if left_s is None:
        return FinalStages(held, ablation)
    if not s.fit_target or fits(held, ablation):
        return FinalStages(held, ablation, estimate_s=estimate(held, ablation))
    trims = [(held, min(ablation, 1)), (min(held, 1), min(ablation, 1)), (min(held, 1), 0)]
    for h, a in trims:
        if fits(h, a):
            said = []
            if a < ablation:
                said.append(f"the ablation ran {a} repetition (not {ablation})" if a else "the ablation did not run")
            if h < held:
                said.append(f"the held-out check ran {h} repetition (not {held})")
            return FinalStages(h, a, tuple(said), estimate(h, a))
    return FinalStages(held, ablation, estimate_s=estimate(held, ablation))


def _predict(sim: RoundSimulator, costs: CostModel, spec: DraftSpec) -> dict:
    """Predicted acceptance, tokens per round and decode speedup over ``sim``'s prompts."""
    counts = sim.simulate(spec)
    return {"acceptance": counts.acceptance, "tokens_per_round": counts.tokens_per_round,
            "decode_speedup": costs.predicted_speedup(counts, spec)}


def search(lm: LoadedModel, prompt_set: PromptSet, s: SearchSettings, on_trial: Callable | None = None,
           extra_provenance: dict | None = None, setup_seconds: float = 0.0) -> SearchReport | None:
    """The whole search, as one worker of the study: any number may run at once (one machine or many).

    Calibration is done once per study and shared; each worker seeds its sampler with
    ``seed + its slot``; the workers together run ``n_trials``. The worker that finds
    the budget spent and no trial running elsewhere re-times the best drafts and writes
    the draft file; the others return None. ``setup_seconds``: what the caller spent before (fetching and
    loading), counted against ``s.time_target_s``.
    """
    space = SearchSpace(lm.num_layers, s.min_skipped, s.max_skipped, s.protect_first_last, s.space)
    space.check()
    check_writable(Path(s.plans_dir), "draft files")
    storage = open_storage(s.storage)
    with worker_slot(storage, s.study_name) as slot:
        return _search(lm, prompt_set, s, space, storage, slot, on_trial, extra_provenance, setup_seconds)


def _search(lm: LoadedModel, prompt_set: PromptSet, s: SearchSettings, space: SearchSpace, storage, slot: int,
            on_trial: Callable | None, extra_provenance: dict | None, setup_seconds: float) -> SearchReport | None:
    t_start, started = time.perf_counter(), time.time()
    calib_ids = [encode_prompt(lm.tokenizer, p) for p in prompt_set.calibration]
    held = prompt_set.heldout
    held_ids = [encode_prompt(lm.tokenizer, held[i]) for i in spread(len(held), s.heldout.prompts)]
    timed_rows = spread(len(calib_ids), s.retime.prompts)
    plans_dir = Path(s.plans_dir)
    study = open_study(storage, s.study_name, lm.name, s.sampler, s.seed + slot, s.prune)
    if study.user_attrs.get("format") is None and study.get_trials(deepcopy=False):
        raise SelfSpecError(f"study {s.study_name!r} in {s.storage} was made by an older selfspec (skip plans only); "
                            "its trials would not compare: choose another search.study_name")
    pin_study_attr(study, "format", STUDY_FORMAT, "study format {recorded!r} is not this selfspec's")
    pin_study_attr(study, "space", space.describe(),
                   f"study {s.study_name!r} searched another space (budget or draft dimensions differ); "
                   "its trials would not compare: choose another search.study_name")
    pin_study_attr(study, "objective", s.objective,
                   f"study {s.study_name!r} was scored by objective {{recorded!r}}, not {s.objective!r}: "
                   "choose another search.study_name")
    enqueue_warm_starts(study, space, [DraftSpec.load(p) for p in s.warm_start] + (space.anchors() if s.anchors else []))
    stages, t = {}, time.perf_counter()
    conts, costs, cost_note = _calibration(study, storage, lm, calib_ids, space, s)
    stages["calibration and cost model"], t = time.perf_counter() - t, time.perf_counter()
    sim = RoundSimulator(lm.model, calib_ids, conts, lm.eos_ids)
    if s.objective == "predicted":
        objective = PredictedObjective(sim, costs, s.batch)
    else:
        objective = WallclockObjective(lm.model, [calib_ids[i] for i in timed_rows], lm.eos_ids,
                                       s.retime.max_new_tokens)
    progress = _Progress(s.n_trials, finished(study))
    try:
        run_search(study, space, objective, s.n_trials, lm.name, [progress] + ([on_trial] if on_trial else []))
    finally:
        progress.close()
    stages["trials"] = time.perf_counter() - t
    fail_dead_trials(study)
    if running_elsewhere(study) or not try_claim(storage, s.study_name, "writing the draft"):
        print(f"[selfspec] worker {slot} done; other workers are still running trials of study "
              f"{s.study_name!r}: the last one to finish writes the draft", file=sys.stderr)
        return None
    try:
        written = study.user_attrs.get("draft_written") or {}
        if written.get("at", 0.0) > started:  # another worker of this search finished first and wrote it
            print(f"[selfspec] worker {slot} done; {written['by']} wrote the draft to {written['path']}",
                  file=sys.stderr)
            return None
        report = _finish(lm, prompt_set, s, space, study, sim, costs, cost_note, calib_ids, timed_rows, held_ids,
                         plans_dir, t_start, extra_provenance, stages, setup_seconds)
        study.set_user_attr("draft_written", {"at": time.time(), "by": WORKER, "path": report.plan_path})
        return report
    finally:
        release(storage, s.study_name, "writing the draft")


def _calibration(study: optuna.Study, storage, lm: LoadedModel, calib_ids: list[list[int]], space: SearchSpace,
                 s: SearchSettings) -> tuple[list[list[int]], CostModel, str]:
    """The full model's continuations and this machine's cost model: computed by one worker, stored in the study."""
    key = {"model": lm.name, "prompts": calib_ids, "n_tokens": s.calibration_tokens}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    pin_study_attr(study, "calibration", digest,
                   f"study {s.study_name!r} was scored with other calibration prompts or settings; "
                   "its trials would not compare: choose another search.study_name")
    first = _saved_calibration(study, s.storage)
    note = {}

    def ready() -> dict | None:
        saved = study.user_attrs.get(CALIBRATION_ATTR) or first
        if saved.get("key") == key and _costs_fit(saved, space):
            return saved
        return None

    def compute() -> dict:
        saved = dict(study.user_attrs.get(CALIBRATION_ATTR) or first)
        if saved.get("key") != key:
            _stage("calibrating: the full model's continuations (once per study)")
            cfg = DecodeConfig(max_new_tokens=s.calibration_tokens)
            bar = tqdm(calib_ids, desc="calibration", unit="prompt", file=sys.stderr, leave=False)
            saved = {"key": key, "continuations": [autoregressive(lm.model, p, cfg, lm.eos_ids).tokens for p in bar],
                     **({"costs": saved["costs"]} if "costs" in saved else {})}
        if not _costs_fit(saved, space):
            old = CostModel.from_dict(saved["costs"]) if "costs" in saved else None
            _stage("measuring the cost model on this machine")
            context = calib_ids[0] + saved["continuations"][0]
            costs = measure_costs(lm.model, context, space.dims.formats(), sorted(set(space.dims.head_tokens)),
                                  space.dims.longest_verify, s.cost_reps, lm.eos_ids, machine_fingerprint(),
                                  space.dims.head_formats())
            saved["costs"] = costs.to_dict()
            if old is not None and old.machine != costs.machine:
                note["remeasured"] = old.machine
            elif old is not None and old.version != costs.version:
                note["outdated"] = old.version
        study.set_user_attr(CALIBRATION_ATTR, saved)
        return saved

    saved = claimed_once(storage, s.study_name, "calibration", ready, compute)
    costs = CostModel.from_dict(saved["costs"])
    old = note.get("remeasured")
    cost_note = "cost model measured on this machine" if old is None else (
        f"cost model re-measured on this machine; trials were re-scored with it "
        f"(it was measured on {old.get('cpu', '?')} ({old.get('isa', 'ISA not recorded')}), {old.get('cores', '?')} cores, "
        f"torch {old.get('torch', '?')})")
    if "outdated" in note:
        cost_note = (f"cost model re-measured on this machine; trials were re-scored with it (the saved one was "
                     f"measured the way of cost model version {note['outdated']}, this selfspec's is "
                     f"{COST_MODEL_VERSION})")
    return saved["continuations"], costs, cost_note


def _saved_calibration(study: optuna.Study, storage: str) -> dict:
    """The study's calibration; for a study of an earlier selfspec, the ``<storage>.calibration.json`` beside it."""
    saved = study.user_attrs.get(CALIBRATION_ATTR)
    path = storage_file(storage)
    if saved is not None or path is None:
        return saved or {}
    legacy = path.with_name(path.stem + ".calibration.json")
    if not legacy.is_file():
        return {}
    try:
        saved = json.loads(legacy.read_text())
        return saved if isinstance(saved, dict) else {}
    except (OSError, ValueError):
        print(f"[selfspec] {legacy} is unreadable (torn?); calibrating again", file=sys.stderr)
        return {}


def study_calibration(storage: str, study_name: str) -> dict:
    """A study's calibration (``key``: model, prompts, tokens; ``continuations``; ``costs``), for scripts."""
    try:
        study = optuna.load_study(study_name=study_name, storage=open_storage(storage))
    except KeyError:
        raise SelfSpecError(f"no study {study_name!r} in {storage}") from None
    saved = _saved_calibration(study, storage)
    if "continuations" not in saved:
        raise SelfSpecError(f"study {study_name!r} in {storage} has not been calibrated yet")
    return saved


def replay_study(storage: str, study_name: str | None, dtype: str) -> tuple[str, dict, CostModel, LoadedModel]:
    """For scripts that replay a study: its name (``None``: the storage file's stem), its calibration
    (:func:`study_calibration`), its saved cost model, and its model loaded in ``dtype``."""
    name = study_name or Path(storage).stem
    saved = study_calibration(storage, name)
    return name, saved, CostModel.from_dict(saved["costs"]), load_model(saved["key"]["model"], dtype=dtype)


def _costs_fit(saved: dict, space: SearchSpace) -> bool:
    """Whether the saved cost model was measured on this machine and covers the space."""
    if "costs" not in saved:
        return False
    old = CostModel.from_dict(saved["costs"])
    fmts = {weight_format(f) for f in space.dims.formats()}
    heads = {h for h in space.dims.head_tokens if h}
    lows = {head_format(replace(f, head_tokens=h)) for f in space.dims.head_formats() for h in {0, *heads}}
    return (old.machine == machine_fingerprint() and old.version == COST_MODEL_VERSION and fmts <= set(old.draft)
            and "draft_step" in old.overhead and heads <= set(old.head)
            and lows <= set(old.head_low)
            and max(old.t_verify) >= space.dims.longest_verify)


def _finish(lm: LoadedModel, prompt_set: PromptSet, s: SearchSettings, space: SearchSpace, study: optuna.Study,
            sim: RoundSimulator, costs: CostModel, cost_note: str, calib_ids: list[list[int]], timed_rows: list[int],
            held_ids: list[list[int]], plans_dir: Path, t_start: float, extra_provenance: dict | None,
            stages: dict[str, float], setup_seconds: float) -> SearchReport:
    t = time.perf_counter()
    tops = top_drafts(study, space, s.retime.top_n, lm.name, costs if s.objective == "predicted" else None)
    if not tops:
        raise SelfSpecError("no trial finished within the budget; widen min_skipped/max_skipped or run more trials")
    # the best few, and the best one with no sublayer skipped (its options alone): the cost model can price
    # a skip above what it saves (it did on the 0.5B, docs/log.md), and only a real run tells
    entries = [(r.spec, r.value, r.trial.user_attrs.get("predicted_acceptance")) for r in tops]
    alike = {r.spec.key: [t.describe() for t in r.twins] for r in tops}  # predicted alike: not re-timed
    twin = skip_free(tops[0].spec)
    if space.within(twin.plan) and twin.key not in {spec.key for spec, _, _ in entries}:
        p = _predict(sim, costs, twin)
        entries.append((twin, p["decode_speedup"], p["acceptance"]))
    # re-time them with real runs, then pick by measured speedup
    timed_ids = [calib_ids[i] for i in timed_rows]
    _stage(f"re-timing the best {len(entries)} drafts with real runs ({len(timed_ids)} calibration prompts, "
           f"{s.retime.reps} reps)")
    timed_conts: list[list[int]] = []  # the full model's continuations of the timed prompts, as long as the runs
    t_runs = time.perf_counter()
    timed = retime(lm.model, timed_ids, [spec for spec, _, _ in entries], lm.eos_ids,
                   s.retime.max_new_tokens, s.retime.reps, ar_tokens=timed_conts, progress="re-timing")
    run_s = (time.perf_counter() - t_runs) / ((1 + len(entries)) * s.retime.reps * len(timed_ids))
    # predictions to set beside the measurements: the same prompts and continuations as the timed runs (the
    # trials' predictions cover every calibration prompt over calibration_tokens, another sample)
    timed_sim = RoundSimulator(lm.model, timed_ids, timed_conts, lm.eos_ids)
    like = [_predict(timed_sim, costs, spec) for spec, _, _ in entries]
    candidates = [{"draft": spec.describe(), "predicted_speedup": value, "predicted_acceptance": acceptance,
                   "predicted_timed_speedup": p["decode_speedup"], "predicted_timed_acceptance": p["acceptance"],
                   "measured_decode_speedup": m["decode_speedup"],
                   "measured_decode_speedup_range": m["decode_speedup_range"], "measured_speedup": m["speedup"],
                   "measured_acceptance": m["acceptance"], "twins": alike.get(spec.key, [])}
                  for (spec, value, acceptance), p, m in zip(entries, like, timed)]
    best_i = max(range(len(entries)), key=lambda i: timed[i]["decode_speedup"])
    best, best_predicted = entries[best_i][0], entries[best_i][1]
    calibration = {"predicted": like[best_i], "measured": _subset(timed[best_i])}
    stages["re-timing"], t = time.perf_counter() - t, time.perf_counter()
    variants = ablation_variants(best) if s.ablation else []
    left = None if s.time_target_s is None else s.time_target_s - setup_seconds - (time.perf_counter() - t_start)
    fit = fit_final_stages(s, left, run_s, len(held_ids), len(timed_ids), len(variants))
    heldout = {"predicted": {}, "measured": {}}
    if held_ids:
        _stage(f"timing the chosen draft on {len(held_ids)} held-out prompts ({s.heldout.max_new_tokens} tokens)")
        held_conts: list[list[int]] = []  # the full model's continuations: AR's tokens in the timed runs
        heldout["measured"] = _subset(retime(lm.model, held_ids, [best], lm.eos_ids, s.heldout.max_new_tokens,
                                             fit.heldout_reps, ar_tokens=held_conts, progress="held-out")[0])
        heldout["predicted"] = _predict(RoundSimulator(lm.model, held_ids, held_conts, lm.eos_ids), costs, best)
        stages["held-out check"], t = time.perf_counter() - t, time.perf_counter()
    ablation = []
    if fit.ablation_reps:
        _stage(f"ablation: the chosen draft without each of its levers ({len(variants)} variants)")
        measured = retime(lm.model, timed_ids, [v for _, v in variants], lm.eos_ids,
                          s.retime.max_new_tokens, fit.ablation_reps, progress="ablation")
        ablation = [{"variant": name, "draft": v.describe(), "predicted": _predict(timed_sim, costs, v),
                     "measured": _subset(m)}
                    for (name, v), m in zip(variants, measured)]
        stages["ablation"] = time.perf_counter() - t
    report = SearchReport(draft=best, predicted_speedup=best_predicted, calibration=calibration, heldout=heldout,
                          trials=finished(study), search_seconds=time.perf_counter() - t_start, plan_path="",
                          cost_model_note=cost_note, candidates=candidates, ablation=ablation, stages=stages,
                          draft_chunks={"run": sim.forwards, "reused": sim.reused}, time_target_s=s.time_target_s,
                          plain_step_s=costs.t_full, loop_overheads=dict(costs.overhead), setup_seconds=setup_seconds,
                          trimmed=list(fit.trimmed),
                          final_stages_s=None if left is None else [fit.estimate_s, left])
    prov = provenance({"model": lm.name, "dataset": prompt_set.name, "dtype": lm.info.get("dtype"),
                       "study": s.study_name, "storage": str(s.storage), "objective": s.objective,
                       "cost_model": costs.to_dict(), "cost_model_note": cost_note, **(extra_provenance or {})})
    plan = SkipPlan(best.plan.num_layers, best.plan.attn, best.plan.mlp, model=lm.name, provenance=prov)
    final = best.replace(plan=plan, measured={"calibration": calibration, "heldout": heldout,
                                               "predicted_speedup": report.predicted_speedup, "ablation": ablation})
    report.draft, report.plan_path = final, str(final.save(plans_dir / f"{s.study_name}.json"))
    return report


def _stage(what: str) -> None:
    print(f"[selfspec] {what}", file=sys.stderr, flush=True)


def _subset(m: dict) -> dict:
    return {k: m[k] for k in ("acceptance", "tokens_per_round", "decode_speedup", "decode_speedup_range", "speedup")
            if k in m}


def _spread(lo_hi: list[float] | None) -> str:
    """The measured decode speedup's range over the repetitions, as printed after it."""
    return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f}x over the repetitions)" if lo_hi and lo_hi[0] != lo_hi[1] else ""


def format_report(r: SearchReport) -> str:
    def row(label: str, d: dict) -> str:
        p, m = d.get("predicted") or {}, d.get("measured") or {}
        if not p:
            return f"{label:<12}-"
        return (f"{label:<12}acceptance {p['acceptance']:.3f} predicted / {m['acceptance']:.3f} measured; "
                f"tokens per round {p['tokens_per_round']:.2f} / {m['tokens_per_round']:.2f}; "
                f"decode speedup {p['decode_speedup']:.2f}x / {m['decode_speedup']:.2f}x"
                f"{_spread(m.get('decode_speedup_range'))} "
                f"(end to end, prefill included: {m['speedup']:.2f}x)")

    lines = ["", f"best draft  {r.draft.describe()}", row("calibration", r.calibration), row("held-out", r.heldout),
             f"trials      {r.trials}; {r.cost_model_note}",
             f"time        {r.search_seconds:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.stages.items())
             + (f"; {r.setup_seconds:.0f} s before it (prompts and model fetched and loaded, kernel built)"
                if r.setup_seconds else ""),
             *([f"chunks      {r.draft_chunks['run']} teacher-forced draft chunks run on the calibration prompts by "
                f"this process, {r.draft_chunks['reused']} answered from memory (earlier trials, same draft forward)"]
               if r.draft_chunks else []),
             "re-timed candidates:"]
    for c in r.candidates:
        timed = c.get("predicted_timed_speedup")  # reports written before it have only the trials' prediction
        on_timed = f", {timed:.2f}x on the timed prompts" if timed is not None else ""
        lines.append(f"  {c['draft']}: decode speedup predicted {c['predicted_speedup']:.2f}x (all calibration "
                     f"prompts){on_timed}, measured {c['measured_decode_speedup']:.2f}x"
                     f"{_spread(c.get('measured_decode_speedup_range'))} "
                     f"(end to end {c['measured_speedup']:.2f}x)")
        if c.get("twins"):
            lines.append(f"    and {len(c['twins'])} more with the same predicted rounds, not re-timed: "
                         + "; ".join(c["twins"][:3]) + ("; ..." if len(c["twins"]) > 3 else ""))
    if r.ablation:
        lines.append("ablation (re-timed calibration prompts; decode speedup predicted / measured, end to end, "
                     "acceptance predicted / measured):")
        for a in r.ablation:
            p, m = a["predicted"], a["measured"]
            spread = _spread(m.get("decode_speedup_range"))
            lines.append(f"  {a['variant']:<28} {p['decode_speedup']:.2f}x / {m['decode_speedup']:.2f}x{spread}, "
                         f"{m['speedup']:.2f}x, acceptance {p['acceptance']:.2f} / {m['acceptance']:.2f}")
    lines.append(f"draft written to {r.plan_path}")
    held = (r.heldout.get("measured") or {}).get("speedup")  # end to end: what a user waits for
    if held is not None and held < 1.0:
        lines.append("note: no real speedup on held-out prompts for this model on this machine (see README).")
    if r.trimmed:
        lines.append(f"note: to finish within the {r.time_target_s:.0f} s target (search.time_target_s), "
                     + ", ".join(r.trimmed) + "; search.fit_target=false runs them as set.")
    lines += [note for note in (prediction_gap(r), heldout_gap(r), time_over(r)) if note]
    return "\n".join(lines)


def time_over(r: SearchReport) -> str | None:
    """A plain line on where the time went, if the run took longer than its target."""
    total = r.setup_seconds + r.search_seconds
    if r.time_target_s is None or total <= r.time_target_s:
        return None
    parts = {**({"fetching and loading": r.setup_seconds} if r.setup_seconds else {}), **r.stages}
    longest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    machine = (r.draft.plan.provenance or {}).get("machine") or {}
    where = ", ".join(str(machine[k]) for k in ("cpu", "isa") if machine.get(k))
    cores = f", {machine['cores']} cores" if machine.get("cores") else ""
    step = (f", where one full-model step of this model took {r.plain_step_s * 1e3:.0f} ms"
            if r.plain_step_s else "")
    return (f"note: {total:.0f} s in all, over the {r.time_target_s:.0f} s target (search.time_target_s) by "
            f"{total - r.time_target_s:.0f} s. The search times real decoding on this CPU ({where or 'unknown'}{cores})"
            f"{step}; its longest parts: " + ", ".join(f"{k} {v:.0f} s" for k, v in longest) + ". Shorter, at the "
            "cost of what they measure: search.ablation=false (no ablation), search.heldout.reps=1, "
            "search.retime.top_n=1, fewer search.n_trials.")


def prediction_gap(r: SearchReport, margin: float = 0.85) -> str | None:
    """A plain line on why the chosen draft ran well below its prediction on the re-timed prompts, if it did
    while its acceptance was as predicted (the cost model's side, not the simulation's)."""
    p, m = r.calibration.get("predicted") or {}, r.calibration.get("measured") or {}
    if not p or not m or m["decode_speedup"] >= margin * p["decode_speedup"]:
        return None
    if abs(p["acceptance"] - m["acceptance"]) > 0.05:
        return None  # the rounds differ: heldout_gap's kind of note, not the cost model's
    o = r.loop_overheads
    overheads = (f" (here {o['verify'] * 1e3:+.1f} ms a verify, {o['draft_step'] * 1e3:+.1f} ms a draft step)"
                 if "verify" in o and "draft_step" in o else "")
    return (f"note: the chosen draft ran at {m['decode_speedup']:.2f}x against {p['decode_speedup']:.2f}x predicted on the "
            f"same prompts and tokens, with acceptance as predicted ({m['acceptance']:.2f} / {p['acceptance']:.2f}): the "
            "cost model priced its rounds too cheap, so the re-timing's measurement chose the draft. Its noisiest part "
            f"is what the decoding loop adds to each forward{overheads}, from a few short runs on a machine whose speed "
            "may drift; `selfspec-inspect round-costs <study storage> --remeasure` prices the same rounds with a cost "
            "model measured now (docs/log.md).")


def heldout_gap(r: SearchReport, margin: float = 0.9) -> str | None:
    """A plain line on why the held-out prompts ran well below the re-timed ones, if they did."""
    cal, held = r.calibration.get("measured") or {}, r.heldout.get("measured") or {}
    if not cal or not held or held["decode_speedup"] >= margin * cal["decode_speedup"]:
        return None
    why = ("the draft agreed with the model less often there" if held["acceptance"] < cal["acceptance"] - 0.05
           else "at about the same acceptance, so the rounds there cost more (shorter copies, other lengths)")
    return (f"note: held-out prompts ran at {held['decode_speedup']:.2f}x against {cal['decode_speedup']:.2f}x on the "
            f"re-timed ones: acceptance {held['acceptance']:.2f} against {cal['acceptance']:.2f}, tokens per round "
            f"{held['tokens_per_round']:.2f} against {cal['tokens_per_round']:.2f}; {why}. Calibration prompts "
            "closer to what you will run (dataset=<yours>) make the search pick for them.")
