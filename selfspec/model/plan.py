"""`SkipPlan`: which sublayers the draft skips.

A plan is a frozen value: two sorted tuples of decoder-layer indices (the
attention sublayers and the MLP sublayers skipped while drafting) plus the
layer count of the model it was made for. It is validated against a model
before use, and saved / loaded as JSON together with free-form provenance.
Nothing here touches a model; `selfspec.draft.skip` applies a plan.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfspec.errors import PlanError

PLAN_FORMAT = "selfspec.skip_plan/1"


def _indices(values: Iterable[int], what: str) -> tuple[int, ...]:
    if not isinstance(values, (list, tuple)):
        raise PlanError(f"{what} must be a list of layer indices, got {values!r}")
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise PlanError(f"{what} must hold integer layer indices, got {v!r}")
        out.append(v)
    if len(set(out)) != len(out):
        raise PlanError(f"{what} lists a layer twice: {sorted(out)}")
    return tuple(sorted(out))


@dataclass(frozen=True)
class SkipPlan:
    """Attention and MLP sublayers skipped while drafting.

    ``num_layers`` is the decoder-layer count of the model the plan was made
    for; ``model`` optionally names it. ``provenance`` is carried along
    unchanged into the JSON file (search objective, measurements, versions).
    """

    num_layers: int
    attn: tuple[int, ...] = ()
    mlp: tuple[int, ...] = ()
    model: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise PlanError(f"num_layers must be a positive integer, got {self.num_layers!r}")
        object.__setattr__(self, "attn", _indices(self.attn, "attn"))
        object.__setattr__(self, "mlp", _indices(self.mlp, "mlp"))
        for what, idx in (("attn", self.attn), ("mlp", self.mlp)):
            bad = [i for i in idx if not 0 <= i < self.num_layers]
            if bad:
                raise PlanError(
                    f"plan skips {what} layers {bad}, outside 0..{self.num_layers - 1} "
                    f"for a {self.num_layers}-layer model"
                )
        if len(self.attn) == self.num_layers and len(self.mlp) == self.num_layers:
            raise PlanError(
                "the plan skips every sublayer: the draft would be the embedding alone; "
                "keep at least one attention or MLP sublayer"
            )

    # -- views -----------------------------------------------------------------
    @property
    def n_skipped(self) -> int:
        """Number of sublayers (attention + MLP) skipped."""
        return len(self.attn) + len(self.mlp)

    def describe(self) -> str:
        return (
            f"skip attn {list(self.attn)} / mlp {list(self.mlp)} "
            f"({self.n_skipped} of {2 * self.num_layers} sublayers)"
        )

    # -- construction ------------------------------------------------------------
    @classmethod
    def whole_layers(cls, num_layers: int, layers: Iterable[int], model: str | None = None) -> SkipPlan:
        """Skip both sublayers of each listed layer."""
        layers = tuple(layers)
        return cls(num_layers=num_layers, attn=layers, mlp=layers, model=model)

    def check_model(self, num_layers: int, model: str | None = None) -> None:
        """Raise :class:`PlanError` unless the plan fits a model with ``num_layers`` layers (named ``model``)."""
        if model and self.model and model != self.model:
            raise PlanError(
                f"this plan was made for model {self.model!r}, not {model!r} (a plan of another model of the "
                f"same depth would run, but draft poorly); search a plan for {model}"
            )
        if num_layers != self.num_layers:
            made_for = f" ({self.model})" if self.model else ""
            raise PlanError(
                f"this plan was made for a {self.num_layers}-layer model{made_for}, "
                f"but the model has {num_layers} layers; search a plan for this model"
            )

    # -- JSON --------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "model": self.model,
            "num_layers": self.num_layers,
            "attn": list(self.attn),
            "mlp": list(self.mlp),
            "provenance": self.provenance,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SkipPlan:
        if not isinstance(data, dict):
            raise PlanError(f"not a selfspec skip plan: a JSON object was expected, got {type(data).__name__}")
        if data.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a selfspec skip plan (format {data.get('format')!r}, expected {PLAN_FORMAT!r})")
        try:
            return cls(
                num_layers=data["num_layers"],
                attn=data.get("attn", ()),
                mlp=data.get("mlp", ()),
                model=data.get("model"),
                provenance=dict(data.get("provenance") or {}),
            )
        except KeyError as e:
            raise PlanError(f"skip plan is missing the field {e.args[0]!r}") from None

    def save(self, path: str | Path) -> Path:
        return write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> SkipPlan:
        return cls.from_dict(read_json(path, "plan file"))


def write_json(path: str | Path, data: dict) -> Path:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # the old file (if any) stays whole; no half-written copy beside it
        raise
    return path


def read_json(path: str | Path, what: str) -> Any:
    """The JSON in ``path``, or a :class:`PlanError` saying it is missing or not JSON."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"no {what} at {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not valid JSON: {e}") from None
