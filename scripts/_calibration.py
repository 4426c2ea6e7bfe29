"""Calibration prompts for the measurement scripts: the first turns of each task set's
calibration split (``conf/dataset/<name>.yaml``), never its eval rows."""

from __future__ import annotations

from pathlib import Path

import yaml

from selfspec.assets.data import load_task_set
from selfspec.assets.models import encode_prompt

CONF = Path(__file__).resolve().parent.parent / "conf" / "dataset"


def calibration_prompts(tokenizer, datasets: list[str], per_dataset: int) -> list[list[int]]:
    prompts = []
    for name in datasets:
        ts = load_task_set(yaml.safe_load((CONF / f"{name}.yaml").read_text()))
        prompts += [encode_prompt(tokenizer, s.turns[0]) for s in ts.calibration[:per_dataset]]
    return prompts
