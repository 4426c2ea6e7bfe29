"""Plain mappings (a config group, a method's options) into typed, frozen settings.

Entry points turn configs into plain dicts and hand them here; the dataclass
holds each default (the YAML in ``conf/`` carries the same values, and a test
checks that the two agree). A key the dataclass does not know is one clear
error, not a silent no-op; nested dataclasses are built from nested mappings
and lists become tuples where the field is a tuple.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, TypeVar

from selfspec.errors import SelfSpecError

T = TypeVar("T")


def typed(cls: type[T], mapping: dict[str, Any] | None, where: str) -> T:
    """``cls(**mapping)``, with nested dataclasses built too and unknown keys refused."""
    mapping = dict(mapping or {})
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(mapping) - set(fields))
    if unknown:
        raise SelfSpecError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} in {where}; "
                            f"known: {', '.join(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in mapping.items():
        hint = hints.get(name)
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = typed(hint, value, f"{where}.{name}")
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        else:
            _check_scalar(f"{where}.{name}", hint, value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise SelfSpecError(f"bad value in {where}: {e}") from None


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_scalar(key: str, hint: Any, value: Any) -> None:
    """Refuse a value of the wrong kind for a plain bool/int/float/str field (``None`` where the field allows it),
    naming the key and the value: a config's ``temperature=abc`` is a user's typo, not a TypeError deep inside."""
    allowed = set(typing.get_args(hint)) if typing.get_origin(hint) in (typing.Union, types.UnionType) else {hint}
    if not allowed <= set(_KINDS) | {type(None)}:
        return  # a field of another kind (tuples, nested settings, ...) checks itself
    if value is None and type(None) in allowed:
        return
    ok = any(isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
             or (kind is float and isinstance(value, int) and not isinstance(value, bool)) for kind in allowed)
    if not ok:
        kinds = " or ".join(_KINDS[k] for k in _KINDS if k in allowed) + (" or null" if type(None) in allowed else "")
        raise SelfSpecError(f"{key} must be {kinds}, got {value!r}")


def defaults(cls: type) -> dict[str, Any]:
    """The default of every field of ``cls`` (nested dataclasses as dicts, tuples as lists), as a YAML file writes them."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        out[f.name] = _as_yaml(dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)
    return out


def _as_yaml(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _as_yaml(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_yaml(v) for v in value]
    return value
