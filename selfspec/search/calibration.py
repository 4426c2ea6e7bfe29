"""The search's calibration, pinned to its study: the full model's continuations and the cost model, computed by
one worker and read back by every other (and by the diagnostics, :func:`replay_study`)."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import optuna
from tqdm.auto import tqdm

from selfspec.assets.models import LoadedModel, load_model
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.errors import SelfSpecError
from selfspec.provenance import machine_fingerprint
from selfspec.search.costs import COST_MODEL_VERSION, CostModel, head_format, measure_costs, weight_format
from selfspec.search.report import stage
from selfspec.search.settings import SearchSettings
from selfspec.search.space import SearchSpace
from selfspec.search.study import (
    pin_study_attr,
)
from selfspec.search.workers import (
    claimed_once,
    open_storage,
    storage_file,
)

STUDY_FORMAT = "selfspec.study/2"  # trials are whole drafts with their round counts
CALIBRATION_ATTR = "calibration_data"  # the study's calibration: continuations and the cost model


def calibrate(study: optuna.Study, storage, lm: LoadedModel, calib_ids: list[list[int]], space: SearchSpace,
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
        if saved.get("key") == key and costs_fit(saved, space):
            return saved
        return None

    def compute() -> dict:
        saved = dict(study.user_attrs.get(CALIBRATION_ATTR) or first)
        if saved.get("key") != key:
            stage("calibrating: the full model's continuations (once per study)")
            cfg = DecodeConfig(max_new_tokens=s.calibration_tokens)
            bar = tqdm(calib_ids, desc="calibration", unit="prompt", file=sys.stderr, leave=False)
            saved = {"key": key, "continuations": [autoregressive(lm.model, p, cfg, lm.eos_ids).tokens for p in bar],
                     **({"costs": saved["costs"]} if "costs" in saved else {})}
        if not costs_fit(saved, space):
            old = CostModel.from_dict(saved["costs"]) if "costs" in saved else None
            stage("measuring the cost model on this machine")
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

    saved = claimed_once(storage, s.study_name, "calibration", ready, compute, live=s.liveness)
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


def costs_fit(saved: dict, space: SearchSpace) -> bool:
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
