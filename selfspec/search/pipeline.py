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

import sys
import time
from collections.abc import Callable
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from selfspec.assets.data import PromptSet
from selfspec.assets.models import LoadedModel, encode_prompt
from selfspec.assets.vocab import has_rank
from selfspec.draft.lowbit import group_width
from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from selfspec.locks import check_writable
from selfspec.model.plan import SkipPlan
from selfspec.provenance import provenance
from selfspec.search.calibration import STUDY_FORMAT, calibrate
from selfspec.search.costs import CostModel
from selfspec.search.report import SearchReport, measured_part, stage
from selfspec.search.retime import WallclockObjective, retime
from selfspec.search.settings import SearchSettings, fit_final_stages
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import SearchSpace, fitting_groups, fitting_heads
from selfspec.search.study import (
    PredictedObjective,
    enqueue_warm_starts,
    finished,
    in_head_rescoring,
    open_study,
    pin_study_attr,
    run_search,
    top_drafts,
    warm_start_params,
)
from selfspec.search.variants import ablation_variants, skip_free, spread
from selfspec.search.workers import WORKER, fail_dead_trials, open_storage, running_elsewhere, waiting, worker_slot


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
    width = group_width(lm.model)
    dims = fitting_groups(s.space, width)
    if dims.group_size != s.space.group_size:
        print(f"[selfspec] int4 groups of {', '.join(str(g) for g in s.space.group_size if g not in dims.group_size)} "
              f"do not divide this model's linear inputs (multiples of {width}): searching groups of "
              f"{', '.join(map(str, dims.group_size))}", file=sys.stderr)
    heads = fitting_heads(dims, has_rank(lm.model))
    if heads != dims:
        dims = heads
        print("[selfspec] this model has no token ranking (it was not loaded by selfspec.assets.models.load_model): "
              "a cut head's base is its lowest ids", file=sys.stderr)
    space = SearchSpace(lm.num_layers, s.min_skipped, s.max_skipped, s.protect_first_last, dims)
    space.check()
    check_writable(Path(s.plans_dir), "draft files")
    # warm starts are read and checked before the study is opened: a refused one leaves no empty study behind
    warm = [in_head_rescoring(space, DraftSpec.load(p)) for p in s.warm_start] + (space.anchors() if s.anchors else [])
    warm_start_params(space, warm)
    storage = open_storage(s.storage)
    with worker_slot(storage, s.study_name, s.liveness) as slot:
        return _search(lm, prompt_set, s, space, storage, slot, warm, on_trial, extra_provenance, setup_seconds)


def _search(lm: LoadedModel, prompt_set: PromptSet, s: SearchSettings, space: SearchSpace, storage, slot: int,
            warm: list[DraftSpec], on_trial: Callable | None, extra_provenance: dict | None,
            setup_seconds: float) -> SearchReport | None:
    t_start, started = time.perf_counter(), time.time()
    calib_ids = [encode_prompt(lm.tokenizer, p) for p in prompt_set.calibration]
    held = prompt_set.heldout
    held_ids = [encode_prompt(lm.tokenizer, held[i]) for i in spread(len(held), s.heldout.prompts)]
    timed_rows = spread(len(calib_ids), s.retime.prompts)
    plans_dir = Path(s.plans_dir)
    study = open_study(storage, s.study_name, lm.name, s.sampler, s.seed + slot, s.prune, s.liveness)
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
    enqueue_warm_starts(study, space, warm)
    stages, t = {}, time.perf_counter()
    conts, costs, cost_note = calibrate(study, storage, lm, calib_ids, space, s)
    stages["calibration and cost model"], t = time.perf_counter() - t, time.perf_counter()
    sim = RoundSimulator(lm.model, calib_ids, conts, lm.eos_ids)
    if s.objective == "predicted":
        objective = PredictedObjective(sim, costs, s.batch)
    else:
        objective = WallclockObjective(lm.model, [calib_ids[i] for i in timed_rows], lm.eos_ids,
                                       s.retime.max_new_tokens)
    progress = _Progress(s.n_trials, finished(study))
    try:
        run_search(study, space, objective, s.n_trials, lm.name, [progress] + ([on_trial] if on_trial else []),
                   s.liveness)
    finally:
        progress.close()
    stages["trials"] = time.perf_counter() - t
    fail_dead_trials(study, s.liveness)
    # the last worker to finish writes the draft. A worker that finds the claim held waits for it and decides in
    # turn: one that gave up instead could leave no writer (the holder saw its last trial still running, while it
    # took the claim to be the writer's)
    with waiting(storage, s.study_name, "writing the draft", s.liveness, poll_s=min(2.0, s.liveness.heartbeat_s)):
        if running_elsewhere(study, live=s.liveness):
            print(f"[selfspec] worker {slot} done; other workers are still running trials of study "
                  f"{s.study_name!r}: the last one to finish writes the draft", file=sys.stderr)
            return None
        written = study.user_attrs.get("draft_written") or {}
        if written.get("at", 0.0) > started:  # another worker of this search finished first and wrote it
            print(f"[selfspec] worker {slot} done; {written['by']} wrote the draft to {written['path']}",
                  file=sys.stderr)
            return None
        report = _finish(lm, prompt_set, s, space, study, sim, costs, cost_note, calib_ids, timed_rows, held_ids,
                         plans_dir, t_start, extra_provenance, stages, setup_seconds)
        study.set_user_attr("draft_written", {"at": time.time(), "by": WORKER, "path": report.plan_path})
        return report


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
    stage(f"re-timing the best {len(entries)} drafts with real runs ({len(timed_ids)} calibration prompts, "
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
    calibration = {"predicted": like[best_i], "measured": measured_part(timed[best_i])}
    stages["re-timing"], t = time.perf_counter() - t, time.perf_counter()
    variants = ablation_variants(best) if s.ablation else []
    left = None if s.time_target_s is None else s.time_target_s - setup_seconds - (time.perf_counter() - t_start)
    fit = fit_final_stages(s, left, run_s, len(held_ids), len(timed_ids), len(variants))
    heldout = {"predicted": {}, "measured": {}}
    if held_ids:
        stage(f"timing the chosen draft on {len(held_ids)} held-out prompts ({s.heldout.max_new_tokens} tokens)")
        held_conts: list[list[int]] = []  # the full model's continuations: AR's tokens in the timed runs
        heldout["measured"] = measured_part(retime(lm.model, held_ids, [best], lm.eos_ids, s.heldout.max_new_tokens,
                                             fit.heldout_reps, ar_tokens=held_conts, progress="held-out")[0])
        heldout["predicted"] = _predict(RoundSimulator(lm.model, held_ids, held_conts, lm.eos_ids), costs, best)
        stages["held-out check"], t = time.perf_counter() - t, time.perf_counter()
    ablation = []
    if fit.ablation_reps:
        stage(f"ablation: the chosen draft without each of its levers ({len(variants)} variants)")
        measured = retime(lm.model, timed_ids, [v for _, v in variants], lm.eos_ids,
                          s.retime.max_new_tokens, fit.ablation_reps, progress="ablation")
        ablation = [{"variant": name, "draft": v.describe(), "predicted": _predict(timed_sim, costs, v),
                     "measured": measured_part(m)}
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
    report.draft = final
    try:
        report.plan_path = str(final.save(plans_dir / f"{s.study_name}.json"))
    except OSError as e:  # a full or read-only plans_dir: the report and the draft still reach the terminal
        report.unsaved = f"cannot write the draft to {plans_dir / f'{s.study_name}.json'}: {e.strerror or e}"
    return report


