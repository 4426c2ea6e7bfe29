"""Linear weights prepacked for oneDNN, used by our decoding loop (a lean-loop option).

A one-token decode step is a chain of matrix-vector products, and on CPU the
stock ``nn.Linear`` hands oneDNN a plain row-major weight on every call.
Reordering each bf16 weight once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and calling
``torch.ops.mkldnn._linear_pointwise`` on it reads the same bytes faster: on
this 2-core CPU one 1536x8960 product went from ~19 to ~26 GB/s of weights
(results/PERF.md). In bf16 the result is bit-identical to ``nn.Linear``'s, so
decoding with packed weights emits the same tokens as without.

:func:`weight_packer` wraps every ``nn.Linear`` of *one* model instance in
place with a :class:`PackedLinear` (no transformers class is patched) and
keeps the packed copies; they are used only inside
``with packer.packed():``, which both of our decoding methods enter, so the
autoregressive baseline and self-speculative decoding share the same forward
path. Outside the block every linear computes exactly as before (the
transformers baselines in the same process run the stock model). The copies
are extra memory (:attr:`WeightPacker.extra_bytes`); only bf16 weights on CPU
are packed, everything else runs as loaded.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight gets a packed copy: bf16 on a CPU with oneDNN."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and torch.backends.mkldnn.is_available()


class LinearWrapper(nn.Module):
    """A linear layer wrapped in place, with another way to compute it while ``active``.

    Reads as the wrapped layer (``weight``, ``bias``, feature counts); the
    subclass's ``forward`` calls ``inner`` when not active.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.out_features = inner.out_features
        self.in_features = inner.in_features
        self.active = False

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias


class PackedLinear(LinearWrapper):
    """An ``nn.Linear`` that also keeps its weight in oneDNN's layout, used while ``active``."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__(inner)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(inner.weight.detach(), 1)

    @property
    def extra_bytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.inner(x)
        bias = self.inner.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None if bias is None else bias.detach(),
                                                  "none", [], "")


class WeightPacker:
    """Owns the :class:`PackedLinear` wrappers of one model; switch them on with :meth:`packed`."""

    def __init__(self, model: nn.Module) -> None:
        self.linears: list[PackedLinear] = _wrap(model)
        self.depth = 0

    @property
    def extra_bytes(self) -> int:
        return sum(lin.extra_bytes for lin in self.linears)

    @contextmanager
    def packed(self) -> Iterator[None]:
        """Within the block the wrapped linears use their packed weights (blocks may nest)."""
        self.depth += 1
        try:
            for lin in self.linears:
                lin.active = True
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                for lin in self.linears:
                    lin.active = False


def _wrap(module: nn.Module) -> list[PackedLinear]:
    out = []
    for name, child in list(module.named_children()):
        if isinstance(child, PackedLinear):
            out.append(child)
        elif isinstance(child, nn.Linear) and can_pack(child.weight):
            wrapped = PackedLinear(child)
            setattr(module, name, wrapped)
            out.append(wrapped)
        else:  # also looks inside other wrappers (skippable sublayers, draft linears, the cut head)
            out += _wrap(child)
    return out


_PACKER_ATTR = "_selfspec_packer"


def weight_packer(model: nn.Module) -> WeightPacker:
    """The :class:`WeightPacker` of ``model``, packing its linears on first use (a few seconds for 1.5B)."""
    packer = model.__dict__.get(_PACKER_ATTR)
    if packer is None:
        packer = WeightPacker(model)
        model.__dict__[_PACKER_ATTR] = packer
    return packer


@contextmanager
def packed_weights(model: nn.Module, on: bool = True) -> Iterator[None]:
    """Run ``model`` on its packed weights inside the block (packing them on first use); ``on=False``: as loaded."""
    if not on:
        yield
        return
    with weight_packer(model).packed():
        yield
