"""A draft whose gated MLPs keep only their largest channels (contextual activation sparsity).

A gated MLP computes ``down(act(gate(x)) * up(x))``. Where a channel's ``act(gate(x))`` is zeroed, the product
needs neither that channel's row of ``up`` nor its column of ``down``: a draft that keeps a fraction ``f`` of each
token's channels, those of the largest ``|act(gate(x))|`` (CATS' rule, a top-k per token here rather than a fitted
threshold), would read its gate weights whole and ``f`` of its up and down weights, ``(1 + 2f) / 3`` of the MLP's
bytes. :class:`TopChannels` wraps one MLP's activation module of one model instance in place and zeroes the others
while its ``keep`` is below 1 (``DraftOptions.mlp_keep``, switched inside :meth:`DraftPath.drafting`); the rest of the
MLP runs as it is, so the draft computes what such a kernel would, at the dense cost: no kernel here reads fewer
bytes. ``selfspec-inspect route-bounds --keep`` simulates what the sparsity costs in acceptance and prices what it
could save (docs/skipping.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.model.wrap import wrap_attr

ACT = "act_fn"  # the activation module of a Llama / Qwen2 / Gemma3 MLP


class TopChannels(nn.Module):
    """An MLP's activation that keeps each row's ``keep`` fraction of channels of the largest magnitude (1: all)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.keep = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if self.keep >= 1.0:
            return y
        n = max(1, math.ceil(self.keep * y.shape[-1]))
        kept = y.abs().topk(n, dim=-1).indices
        return torch.zeros_like(y).scatter_(-1, kept, y.gather(-1, kept))


def top_channels(mlp: nn.Module) -> TopChannels:
    """The :class:`TopChannels` around ``mlp``'s activation, put in place on first use."""
    if not isinstance(getattr(mlp, ACT, None), nn.Module):
        raise SelfSpecError(f"mlp_keep needs a gated MLP with an activation module ({ACT}); "
                            f"{type(mlp).__name__} has none")
    return wrap_attr(mlp, ACT, TopChannels, TopChannels)
