"""`DraftSpec`: the whole self-draft, as a search finds it and a plan file stores it.

A self-draft is the skip plan (which attention and MLP sublayers the draft
skips), the draft options (precision of the kept weights, the draft head, copy
drafting: :class:`~selfspec.draft.path.DraftOptions`) and the draft-length
policy (``k`` tokens per round, growing up to ``k_max`` while rounds are accepted whole, or the adaptive exit
with its threshold). The
file format ``selfspec.draft/2`` stores all of it as fields, plus what was
measured and where (``measured``, ``provenance``: machine, versions, commit).
Files of the older format ``selfspec.skip_plan/1`` (a skip plan alone, ``k`` in
its provenance) load as a draft with default options.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.draft.path import (
    DEFAULT_ADAPTIVE,
    DEFAULT_K,
    DEFAULT_K_MAX,
    DEFAULT_THRESHOLD,
    DEFAULT_THRESHOLD_STEP,
    DraftOptions,
)
from selfspec.errors import PlanError, SelfSpecError
from selfspec.model.plan import PLAN_FORMAT, SkipPlan, read_json, write_json

DRAFT_FORMAT = "selfspec.draft/2"
DRAFT_KEYS = frozenset({"format", "model", "num_layers", "attn", "mlp", "options", "k", "adaptive", "threshold",
                        "k_max", "threshold_step", "measured", "provenance"})  # the fields of a draft file (DraftSpec.to_dict)
# the draft-length policy: a draft file's, a run's decoding settings override it
LENGTH = ("k", "adaptive", "threshold", "k_max", "threshold_step")


@dataclass(frozen=True)
class DraftSpec:
    plan: SkipPlan
    options: DraftOptions = field(default_factory=DraftOptions)
    k: int = DEFAULT_K
    adaptive: bool = DEFAULT_ADAPTIVE
    threshold: float = DEFAULT_THRESHOLD
    k_max: int = DEFAULT_K_MAX
    threshold_step: float = DEFAULT_THRESHOLD_STEP
    measured: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise PlanError(f"k must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.adaptive, bool):
            raise PlanError(f"adaptive must be true or false, got {self.adaptive!r}")
        if not isinstance(self.threshold, (int, float)) or not 0.0 <= self.threshold < 1.0:
            raise PlanError(f"threshold must be a number in [0, 1), got {self.threshold!r}")
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 0:
            raise PlanError(f"k_max must be an integer >= 0 (0: no growth), got {self.k_max!r}")
        if isinstance(self.threshold_step, bool) or not isinstance(self.threshold_step, (int, float)) \
                or not 0.0 <= self.threshold_step < 1.0:
            raise PlanError(f"threshold_step must be a number in [0, 1) (0: a fixed threshold), got {self.threshold_step!r}")
        if self.k_max <= self.k:  # a draft that cannot grow past k is the fixed-k draft: one field, one key, one file
            object.__setattr__(self, "k_max", 0)

    @property
    def length(self) -> dict[str, Any]:
        """The draft-length policy as the decoding loop takes it (:data:`LENGTH` of ``DecodeConfig``)."""
        return {name: getattr(self, name) for name in LENGTH}

    @property
    def longest_draft(self) -> int:
        """The most tokens one model draft makes: ``k``, or ``k_max`` for a draft that grows past it."""
        return self.k_max or self.k

    @property
    def key(self) -> tuple:
        """What makes two drafts the same draft (not what was measured)."""
        o = self.options
        key = (self.plan.attn, self.plan.mlp, o.weights, o.group_for(o.weights),
               o.head_tokens, o.ngram, o.copy_tokens if o.ngram else 0, self.k, self.adaptive,
               round(self.threshold, 3) if self.adaptive else None,
               (o.copy_candidates if o.ngram else 1, round(o.branch_below, 3), o.tree_nodes, o.copy_fallback)
               if o.tree else None)
        # options added later join only when set, so the keys of older drafts stay as they were
        if o.head_weights != "model":
            key += (o.head_weights, o.group_for(o.head_weights))
        if o.ngram and o.min_ngram:
            key += (("min_ngram", o.min_ngram),)
        if not o.model_draft:
            key += ("copy_only",)
        if o.ngram and o.copy_per_match:
            key += (("copy_per_match", o.copy_per_match),)
        if o.int4 and o.int4_fit != "minmax":
            key += (("int4_fit", o.int4_fit),)
        if o.head_rescore:
            key += (("head_rescore", o.head_rescore),)
        if o.head_ids != "lowest":
            key += (("head_ids", o.head_ids),)
        if self.k_max:
            key += (("k_max", self.k_max),)
        if self.adaptive and self.threshold_step != DEFAULT_THRESHOLD_STEP:
            key += (("threshold_step", round(self.threshold_step, 3)),)
        if o.mlp_keep < 1.0:
            key += (("mlp_keep", round(o.mlp_keep, 3)),)
        return key

    def describe(self) -> str:
        o = self.options
        # a copy-only draft runs no model draft: its plan and the model draft's options are unused
        parts = [self.plan.describe() if o.model_draft else "copy only (a plain step where nothing matched)"]
        fit = "" if o.int4_fit == "minmax" else f" {o.int4_fit}"
        if o.weights != "model":
            parts.append(f"{o.weights}" + (f" g{o.group_size}{fit}" if o.weights == "int4" else ""))
        if o.mlp_keep < 1.0:
            parts.append(f"MLP channels: top {o.mlp_keep:.0%}")
        if o.head_tokens or o.head_weights != "model":
            low = "" if o.head_weights == "model" else f" {o.head_weights}" + (
                f" g{o.group_size}{fit}" if o.head_weights == "int4" else "") + (
                f" top {o.head_rescore} rescored" if o.head_rescore else "")
            ids = f" {o.head_ids}" if o.head_ids != "lowest" else ""
            parts.append(f"head {o.head_tokens or 'full'}{ids}{low}")
        if o.ngram:
            parts.append(f"{o.ngram}-gram copy" + (f" (down to {o.min_ngram}-gram)" if o.min_ngram else "")
                         + (f" up to {o.copy_tokens}" if o.copy_tokens else "")
                         + (f", {o.copy_per_match} per matched token" if o.copy_per_match else ""))
        if o.tree:
            tree = [f"{o.copy_candidates} copy candidates"] if o.ngram and o.copy_candidates > 1 else []
            tree += [f"branch below {o.branch_below:.2f}"] if o.branch_below else []
            tree += [f"{o.copy_fallback}-gram copies beside the model draft"] if o.copy_fallback else []
            parts.append(f"tree ({', '.join(tree)}, <= {o.tree_nodes} nodes)")
        parts.append(f"k={self.k}" + (f" growing to {self.k_max}" if self.k_max else "")
                     + (f" adaptive {self.threshold:.2f}" if self.adaptive else "")
                     + ((" fixed" if not self.threshold_step else f" step {self.threshold_step:g}")
                        if self.adaptive and self.threshold_step != DEFAULT_THRESHOLD_STEP else ""))
        return ", ".join(parts)

    def replace(self, **changes) -> DraftSpec:
        return dataclasses.replace(self, **changes)

    # -- JSON ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DRAFT_FORMAT,
            "model": self.plan.model,
            "num_layers": self.plan.num_layers,
            "attn": list(self.plan.attn),
            "mlp": list(self.plan.mlp),
            "options": dataclasses.asdict(self.options),
            "k": self.k,
            "adaptive": self.adaptive,
            "threshold": self.threshold,
            **({"k_max": self.k_max} if self.k_max else {}),
            **({"threshold_step": self.threshold_step} if self.threshold_step != DEFAULT_THRESHOLD_STEP else {}),
            "measured": self.measured,
            "provenance": self.plan.provenance,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "the draft file") -> DraftSpec:
        if not isinstance(data, dict):
            raise PlanError(f"{where} holds {type(data).__name__}, not a selfspec draft (a JSON object)")
        fmt = data.get("format")
        if fmt == PLAN_FORMAT:  # a skip plan alone: default options, k from its provenance
            plan = SkipPlan.from_dict(data)
            k = (plan.provenance or {}).get("k", cls.k)
            return cls(plan, k=k)
        if fmt != DRAFT_FORMAT:
            raise PlanError(f"{where} is not a selfspec draft (format {fmt!r}, expected {DRAFT_FORMAT!r} "
                            f"or {PLAN_FORMAT!r})")
        unknown = sorted(set(data) - DRAFT_KEYS)
        if unknown:
            import difflib

            hints = [f"{k!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(k, DRAFT_KEYS, 1))
                     else repr(k) for k in unknown]
            raise PlanError(f"{where}: unknown field(s) {', '.join(hints)}; a draft holds {', '.join(sorted(DRAFT_KEYS))}")
        options = data.get("options") or {}
        if not isinstance(options, dict):
            raise PlanError(f"{where}: options must be an object, got {options!r}")
        provenance = data.get("provenance") or {}
        if not isinstance(provenance, dict):
            raise PlanError(f"{where}: provenance must be an object, got {type(provenance).__name__}")
        try:
            plan = SkipPlan.from_dict({**data, "format": PLAN_FORMAT, "provenance": provenance})
            return cls(plan, DraftOptions(**options), k=data.get("k", cls.k), adaptive=data.get("adaptive", cls.adaptive),
                       threshold=data.get("threshold", cls.threshold),
                       k_max=data.get("k_max", cls.k_max), threshold_step=data.get("threshold_step", cls.threshold_step),
                       measured=dict(data.get("measured") or {}))
        except TypeError as e:
            raise PlanError(f"{where}: {e}") from None
        except SelfSpecError as e:
            raise PlanError(f"{where}: {e}") from None

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> DraftSpec:
        return cls.from_dict(read_json(path, "draft file"), str(path))
