"""A cut LM head for drafting: score only a chosen set of token ids.

The full head of a 150k-token vocabulary costs as much as a few decoder
layers. :class:`CutHead` wraps the model's output embedding in place; while
``active`` it computes logits for the chosen ids only (``-inf`` elsewhere);
otherwise it is the wrapped head.
"""

from __future__ import annotations

import torch
from torch import nn


class CutHead(nn.Module):
    """The LM head, scoring only a chosen set of token ids while ``active``."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.ids: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None
        self.active = False

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    def choose(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self.rows = self.inner.weight.detach().index_select(0, ids).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active or self.ids is None:
            return self.inner(x)
        sub = torch.nn.functional.linear(x, self.rows)
        out = x.new_full((*x.shape[:-1], self.inner.out_features), float("-inf"))
        out[..., self.ids] = sub
        return out
