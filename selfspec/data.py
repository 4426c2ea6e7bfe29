"""Prompt sets: calibration prompts for the search and held-out prompts, never the same.

A :class:`PromptSet` is plain text; encoding (chat template) happens with the
model's tokenizer. ``source: inline`` sets carry their prompts in the config.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SelfSpecError


@dataclass(frozen=True)
class PromptSet:
    name: str
    calibration: tuple[str, ...]
    heldout: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.calibration:
            raise SelfSpecError(f"dataset {self.name!r} has no calibration prompts")
        overlap = set(self.calibration) & set(self.heldout)
        if overlap:
            raise SelfSpecError(f"dataset {self.name!r}: {len(overlap)} prompts are both calibration and held-out")


def prompt_set_from_config(cfg: dict) -> PromptSet:
    source = cfg.get("source", "inline")
    if source != "inline":
        raise SelfSpecError(f"dataset {cfg.get('name')!r}: unknown source {source!r} (supported: inline)")
    return PromptSet(cfg["name"], tuple(cfg.get("calibration") or ()), tuple(cfg.get("heldout") or ()))
