"""Wrapping submodules of one model instance in place, and state held by that instance.

Every way this project changes what a model computes (skipped sublayers,
packed weights, low-precision draft weights, a cut head) replaces a submodule
of *that* model object by a wrapper that holds the original as ``inner``: no
transformers class is patched, other instances are untouched, and wrapping
twice finds the wrapper already there. The per-model owner of those wrappers
(a :class:`~selfspec.draft.skip.LayerSkipper`, a
:class:`~selfspec.kernels.packed.WeightPacker`) lives in the instance's own
``__dict__`` (:func:`instance_state`), not in a global.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

W = TypeVar("W", bound=nn.Module)
S = TypeVar("S")


def wrap_attr(parent: nn.Module, name: str, wrapper: type[W], make: Callable[[nn.Module], W]) -> W:
    """The ``wrapper`` around ``parent.<name>``, made with ``make`` and put in place on first use."""
    child = getattr(parent, name)
    if isinstance(child, wrapper):
        return child
    wrapped = make(child)
    setattr(parent, name, wrapped)
    return wrapped


def wrap_descendants(root: nn.Module, wrapper: type[W], match: Callable[[nn.Module], bool],
                     make: Callable[[nn.Module], W], on_existing: Callable[[W], None] | None = None) -> list[W]:
    """Wrap every descendant of ``root`` that ``match`` accepts; returns all ``wrapper`` modules found.

    A descendant that already is a ``wrapper`` is kept (``on_existing`` may
    reconfigure it) and not entered; other modules, other wrappers included,
    are searched further down.
    """
    found: list[W] = []

    def visit(module: nn.Module) -> None:
        for name, child in list(module.named_children()):
            if isinstance(child, wrapper):
                if on_existing is not None:
                    on_existing(child)
                found.append(child)
            elif match(child):
                wrapped = make(child)
                setattr(module, name, wrapped)
                found.append(wrapped)
            else:
                visit(child)

    visit(root)
    return found


def instance_state(model: nn.Module, attr: str, make: Callable[[], S], valid: Callable[[S], bool] = lambda s: True) -> S:
    """The object stored on ``model`` under ``attr``, made with ``make`` when absent or no longer ``valid``."""
    state = model.__dict__.get(attr)
    if state is None or not valid(state):
        state = make()
        model.__dict__[attr] = state
    return state


def set_plain(module: nn.Module, **values) -> None:
    """Set plain attributes of ``module`` (flags, names, tensors that are neither parameters nor buffers) without
    ``nn.Module.__setattr__``'s checks, which store such values in the instance's ``__dict__`` all the same.
    A draft round switches a few hundred of them (every kept linear, the head, the sublayers), and through those
    checks that cost ~5 ms a round on the 1.5B model (docs/log.md)."""
    for name in values:
        if name in module._parameters or name in module._buffers or name in module._modules:
            raise AttributeError(f"{name} is a parameter, buffer or submodule of {type(module).__name__}")
    module.__dict__.update(values)


def copy_out_of_checkpoint(model: nn.Module) -> None:
    """Copies the remaining parameters and buffers into process memory, so the checkpoint can be unmapped.

    transformers maps the weights file into memory; the pages of freed dense
    weights stay resident while any tensor of that file is alive, so freeing
    them alone saves nothing. The copies hold the same values (a tied weight stays tied).
    """
    with torch.no_grad():
        for p in model.parameters():  # each once: a tied weight is one parameter
            p.data = p.data.clone()
        for module in model.modules():
            for name, t in module._buffers.items():
                if t is not None:
                    module._buffers[name] = t.clone()
