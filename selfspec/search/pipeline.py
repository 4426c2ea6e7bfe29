"""A whole draft search, start to finish, from typed settings (no Hydra, no W&B here).

Steps: encode prompts -> calibrate (the full model's continuations, pinned to
the study; the cost model, re-measured whenever the machine differs from the
one that measured it) -> Optuna trials (each draft's rounds simulated exactly
and priced) -> re-time the top drafts with real self-speculative runs -> report
on held-out prompts, with an ablation of the found draft -> write the draft file.
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
from selfspec.draft.path import DraftOptions
from selfspec.draft.plan import SkipPlan
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.errors import SelfSpecError
from selfspec.locks import check_writable, exclusive
from selfspec.provenance import machine_fingerprint, provenance
from selfspec.search.costs import CostModel, measure_costs, weight_format
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

STUDY_FORMAT = "selfspec.study/2"  # trials are whole drafts with their round counts


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
    calibration_tokens: int = 24
    min_skipped: int = 0
    max_skipped: int | None = None
    protect_first_last: bool = True
    space: DraftDims = field(default_factory=DraftDims)
    warm_start: tuple[str, ...] = ()
    storage: str = "outputs/optuna/search.db"
    study_name: str = "search"
    cost_reps: int = 7
    prune: bool = True
    ablation: bool = True
    seed: int = 0
    plans_dir: str = "outputs/plans"
    retime: RetimeSettings = field(default_factory=RetimeSettings)
    heldout: HeldoutSettings = field(default_factory=HeldoutSettings)

    def __post_init__(self) -> None:
        if self.objective not in ("predicted", "wallclock"):
            raise SelfSpecError(f"unknown objective {self.objective!r}; choose predicted or wallclock")
        _at_least(self, 1, "search", "n_trials", "cost_reps")
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

    def to_dict(self) -> dict:
        d = asdict(self)
        d["draft"] = self.draft.to_dict()
        return d


# -- calibration: acceptance belongs to the model and prompts, cost to the machine --------------

def _continuations(study: optuna.Study, lm: LoadedModel, prompts: list[list[int]], n_tokens: int,
                   saved: dict) -> list[list[int]]:
    key = {"model": lm.name, "prompts": prompts, "n_tokens": n_tokens}
    digest = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    pin_study_attr(study, "calibration", digest,
                   f"study {study.study_name!r} was scored with other calibration prompts or settings; "
                   "its trials would not compare: choose another search.study_name")
    if saved.get("key") == key:
        return saved["continuations"]
    print("[selfspec] calibrating: the full model's continuations (once per study)", file=sys.stderr)
    cfg = DecodeConfig(max_new_tokens=n_tokens)
    conts = [autoregressive(lm.model, p, cfg, lm.eos_ids).tokens for p in prompts]
    saved.clear()
    saved.update(key=key, continuations=conts)
    return conts


def _costs(lm: LoadedModel, context: list[int], space: SearchSpace, reps: int, saved: dict) -> tuple[CostModel, str]:
    """The cost model of this machine: the saved one when it was measured here for this space, else measured now."""
    here = machine_fingerprint()
    formats = space.dims.formats()
    heads = sorted(set(space.dims.head_tokens))
    old = CostModel.from_dict(saved["costs"]) if "costs" in saved else None
    fmts = {weight_format(f) for f in formats}
    if old is not None and old.machine == here and fmts <= set(old.draft) and {f"draft_step/{f}" for f in fmts} <= \
            set(old.overhead) and set(h for h in heads if h) <= set(old.head) and max(old.t_verify) >= space.dims.longest_verify:
        return old, "cost model measured on this machine"
    print("[selfspec] measuring the cost model on this machine", file=sys.stderr)
    costs = measure_costs(lm.model, context, formats, heads, space.dims.longest_verify, reps, lm.eos_ids, here)
    saved["costs"] = costs.to_dict()
    if old is None:
        return costs, "cost model measured on this machine"
    return costs, (f"cost model re-measured on this machine; trials were re-scored with it "
                   f"(it was measured on {old.machine.get('cpu', '?')}, {old.machine.get('cores', '?')} cores, "
                   f"torch {old.machine.get('torch', '?')})")


class _Progress:
    """Optuna callback: a tqdm bar with the best predicted speedup and its acceptance."""

    def __init__(self, total: int, done: int) -> None:
        self.bar = tqdm(total=total, initial=done, desc="search", unit="trial", file=sys.stderr)

    def __call__(self, study: optuna.Study, trial) -> None:
        self.bar.update(1)
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
        out.append(("without skipping", spec.replace(plan=SkipPlan(plan.num_layers, model=plan.model))))
    if o.weights != "model":
        out.append(("without low precision", spec.replace(options=_options(o, weights="model"))))
    if o.head_tokens:
        out.append(("without the cut head", spec.replace(options=_options(o, head_tokens=0))))
    if o.ngram:
        out.append(("without copy drafting", spec.replace(options=_options(o, ngram=0, copy_tokens=0))))
    if spec.adaptive:
        out.append(("fixed k (no adaptive exit)", spec.replace(adaptive=False, threshold=0.5)))
    return out


def cumulative_variants(spec: DraftSpec) -> list[tuple[str, DraftSpec]]:
    """The paper-style ablation: the skip plan alone (the layer-skip papers' draft, at the found k), then
    each lever of the found draft added in turn (the adaptive exit last: it makes the searched draft),
    then the searched draft without skipping. A lever the draft does not use adds no row."""
    o, n = spec.options, spec.plan.num_layers
    plain = DraftSpec(spec.plan, DraftOptions(), k=spec.k)
    steps = [("skip_only", plain),
             ("plus_low_precision", plain.replace(options=_options(plain.options, weights=o.weights,
                                                                    group_size=o.group_size))),
             ("plus_cut_head", plain.replace(options=_options(o, ngram=0, copy_tokens=0))),
             ("plus_copy", plain.replace(options=o))]
    out, seen = [], {spec.key}
    for name, variant in steps:
        if variant.key not in seen:
            seen.add(variant.key)
            out.append((name, variant))
    out.append(("searched", spec))
    if spec.plan.n_skipped:
        out.append(("searched_no_skip", spec.replace(plan=SkipPlan(n, model=spec.plan.model))))
    return out


def _options(o: DraftOptions, **changes) -> DraftOptions:
    return DraftOptions(**{**asdict(o), **changes})


def _predict(sim: RoundSimulator, costs: CostModel, spec: DraftSpec, prompts: int | None = None) -> dict:
    """Predicted acceptance, tokens per round and decode speedup (over the first ``prompts`` prompts, else all)."""
    counts = sim.simulate(spec, prompts=range(prompts) if prompts is not None else None)
    return {"acceptance": counts.acceptance, "tokens_per_round": counts.tokens_per_round,
            "decode_speedup": costs.predicted_speedup(counts, spec)}


def search(lm: LoadedModel, prompt_set: PromptSet, s: SearchSettings, on_trial: Callable | None = None,
           extra_provenance: dict | None = None) -> SearchReport:
    """The whole search; one process at a time per study (a second one is refused with a clear error)."""
    with exclusive(Path(s.storage), f"the study {s.storage}"):
        return _search(lm, prompt_set, s, on_trial, extra_provenance)


def _search(lm: LoadedModel, prompt_set: PromptSet, s: SearchSettings, on_trial: Callable | None,
            extra_provenance: dict | None) -> SearchReport:
    t_start = time.perf_counter()
    calib_ids = [encode_prompt(lm.tokenizer, p) for p in prompt_set.calibration]
    held_ids = [encode_prompt(lm.tokenizer, p) for p in prompt_set.heldout[: s.heldout.prompts]]
    space = SearchSpace(lm.num_layers, s.min_skipped, s.max_skipped, s.protect_first_last, s.space)
    space.check()
    plans_dir = Path(s.plans_dir)
    check_writable(plans_dir, "draft files")
    storage = Path(s.storage)
    study = open_study(storage, s.study_name, lm.name, s.sampler, s.seed, s.prune)
    if study.user_attrs.get("format") is None and study.get_trials(deepcopy=False):
        raise SelfSpecError(f"study {s.study_name!r} in {storage} was made by an older selfspec (skip plans only); "
                            "its trials would not compare: choose another search.study_name")
    pin_study_attr(study, "format", STUDY_FORMAT, "study format {recorded!r} is not this selfspec's")
    pin_study_attr(study, "space", space.describe(),
                   f"study {s.study_name!r} searched another space (budget or draft dimensions differ); "
                   "its trials would not compare: choose another search.study_name")
    pin_study_attr(study, "objective", s.objective,
                   f"study {s.study_name!r} was scored by objective {{recorded!r}}, not {s.objective!r}: "
                   "choose another search.study_name")
    enqueue_warm_starts(study, space, [DraftSpec.load(p) for p in s.warm_start])
    calib_path = storage.with_name(storage.stem + ".calibration.json")
    saved = json.loads(calib_path.read_text()) if calib_path.is_file() else {}
    conts = _continuations(study, lm, calib_ids, s.calibration_tokens, saved)
    costs, cost_note = _costs(lm, calib_ids[0] + conts[0], space, s.cost_reps, saved)
    tmp = calib_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(saved))
    tmp.replace(calib_path)
    sim = RoundSimulator(lm.model, calib_ids, conts, lm.eos_ids)
    if s.objective == "predicted":
        objective = PredictedObjective(sim, costs)
    else:
        objective = WallclockObjective(lm.model, calib_ids[: s.retime.prompts], lm.eos_ids, s.retime.max_new_tokens)
    progress = _Progress(s.n_trials, finished(study))
    try:
        run_search(study, space, objective, s.n_trials, lm.name, [progress] + ([on_trial] if on_trial else []))
    finally:
        progress.close()
    tops = top_drafts(study, space, s.retime.top_n, lm.name, costs if s.objective == "predicted" else None)
    if not tops:
        raise SelfSpecError("no trial finished within the budget; widen min_skipped/max_skipped or run more trials")
    # re-time the best few with real runs, then pick by measured speedup
    timed = retime(lm.model, calib_ids[: s.retime.prompts], [r.spec for r in tops], lm.eos_ids,
                   s.retime.max_new_tokens, s.retime.reps)
    candidates = [{"draft": r.spec.describe(), "predicted_speedup": r.value,
                   "predicted_acceptance": r.trial.user_attrs.get("predicted_acceptance"),
                   "measured_decode_speedup": m["decode_speedup"], "measured_speedup": m["speedup"],
                   "measured_acceptance": m["acceptance"]}
                  for r, m in zip(tops, timed)]
    best_i = max(range(len(tops)), key=lambda i: timed[i]["decode_speedup"])
    best = tops[best_i].spec
    n_timed = min(s.retime.prompts, len(calib_ids))  # predicted on the prompts that were timed
    calibration = {"predicted": _predict(sim, costs, best, n_timed), "measured": _subset(timed[best_i])}
    heldout = {"predicted": {}, "measured": {}}
    if held_ids:
        held_conts = [autoregressive(lm.model, p, DecodeConfig(max_new_tokens=s.heldout.max_new_tokens), lm.eos_ids).tokens
                      for p in held_ids]
        heldout["predicted"] = _predict(RoundSimulator(lm.model, held_ids, held_conts, lm.eos_ids), costs, best)
        heldout["measured"] = _subset(retime(lm.model, held_ids, [best], lm.eos_ids, s.heldout.max_new_tokens,
                                             s.heldout.reps)[0])
    ablation = []
    if s.ablation:
        variants = ablation_variants(best)
        measured = retime(lm.model, calib_ids[: s.retime.prompts], [v for _, v in variants], lm.eos_ids,
                          s.retime.max_new_tokens, s.retime.reps)
        ablation = [{"variant": name, "draft": v.describe(), "predicted": _predict(sim, costs, v, n_timed),
                     "measured": _subset(m)}
                    for (name, v), m in zip(variants, measured)]
    report = SearchReport(draft=best, predicted_speedup=tops[best_i].value, calibration=calibration, heldout=heldout,
                          trials=finished(study), search_seconds=time.perf_counter() - t_start, plan_path="",
                          cost_model_note=cost_note, candidates=candidates, ablation=ablation)
    prov = provenance({"model": lm.name, "dataset": prompt_set.name, "dtype": lm.info.get("dtype"),
                       "study": s.study_name, "storage": str(storage), "objective": s.objective,
                       "cost_model": costs.to_dict(), "cost_model_note": cost_note, **(extra_provenance or {})})
    plan = SkipPlan(best.plan.num_layers, best.plan.attn, best.plan.mlp, model=lm.name, provenance=prov)
    final = best.replace(plan=plan, measured={"calibration": calibration, "heldout": heldout,
                                               "predicted_speedup": report.predicted_speedup, "ablation": ablation})
    report.draft, report.plan_path = final, str(final.save(plans_dir / f"{s.study_name}.json"))
    return report


def _subset(m: dict) -> dict:
    return {k: m[k] for k in ("acceptance", "tokens_per_round", "decode_speedup", "speedup")}


def format_report(r: SearchReport) -> str:
    def row(label: str, d: dict) -> str:
        p, m = d.get("predicted") or {}, d.get("measured") or {}
        if not p:
            return f"{label:<12}-"
        return (f"{label:<12}acceptance {p['acceptance']:.3f} predicted / {m['acceptance']:.3f} measured; "
                f"tokens per round {p['tokens_per_round']:.2f} / {m['tokens_per_round']:.2f}; "
                f"decode speedup {p['decode_speedup']:.2f}x / {m['decode_speedup']:.2f}x "
                f"(end to end, prefill included: {m['speedup']:.2f}x)")

    lines = ["", f"best draft  {r.draft.describe()}", row("calibration", r.calibration), row("held-out", r.heldout),
             f"trials      {r.trials} in {r.search_seconds:.0f} s; {r.cost_model_note}", "re-timed candidates:"]
    for c in r.candidates:
        lines.append(f"  {c['draft']}: decode speedup predicted {c['predicted_speedup']:.2f}x (all calibration "
                     f"prompts), measured {c['measured_decode_speedup']:.2f}x (end to end {c['measured_speedup']:.2f}x)")
    if r.ablation:
        lines.append("ablation (re-timed calibration prompts; decode speedup predicted / measured, end to end, "
                     "acceptance predicted / measured):")
        for a in r.ablation:
            p, m = a["predicted"], a["measured"]
            lines.append(f"  {a['variant']:<28}{p['decode_speedup']:.2f}x / {m['decode_speedup']:.2f}x, "
                         f"{m['speedup']:.2f}x, acceptance {p['acceptance']:.2f} / {m['acceptance']:.2f}")
    lines.append(f"draft written to {r.plan_path}")
    held = (r.heldout.get("measured") or {}).get("speedup")  # end to end: what a user waits for
    if held is not None and held < 1.0:
        lines.append("note: no real speedup on held-out prompts for this model on this machine (see README).")
    return "\n".join(lines)
