"""The draft's LM head: a cut set of token ids, and/or a weight-only quantized copy.

The full head of a 150k-token vocabulary costs as much as a few decoder
layers. :class:`CutHead` wraps the model's output embedding in place; while
``active`` it computes logits for the chosen ids only (``-inf`` elsewhere);
otherwise it is the wrapped head.

With a precision other than ``model`` (:meth:`CutHead.copy_for`), the head's
*base* ids (the same for every request: the most frequent ids and the stop
ids, or the whole vocabulary) are scored through an int8/int4 copy of their
rows, quantized once per format and base and kept, as the kept linears' copies
are (:mod:`selfspec.draft.lowbit`); a request's own extra ids (its prompt's
tokens outside the base) stay on bf16 rows gathered per request. Quantizing
per request would cost more than it saves: on the 1.5B, 1.2 s for 32k int4
rows, against 5.7 ms (bf16) and 1.7 ms (int4) for that head per draft step
(``scripts/draft_heads.py``, ``docs/log.md``).
Verification never uses any of this: outside ``active`` the wrapped head runs.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.draft.lowbit import quantize, quantized_mm
from selfspec.model.wrap import set_plain


class CutHead(nn.Module):
    """The LM head, scoring only a chosen set of token ids while ``active``."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner
        self.ids: torch.Tensor | None = None  # ids scored on bf16 rows (all chosen ids, or those outside the base)
        self.rows: torch.Tensor | None = None
        self.active = False
        self.rescore = 0  # while active with a quantized base: its top ids scored again on bf16 rows (head_rescore)
        # the quantized base: (kernel, group, base ids, packed weight, scales), and every one made so far
        self.low: tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.copies: dict[tuple, tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def vocab(self) -> int:
        return self.inner.out_features

    def copy_for(self, base: torch.Tensor, weights: str, group_size: int, fit: str = "minmax") -> tuple | None:
        """The ``weights`` copy (int8 | int4) of the ``base`` rows (sorted unique ids), made on first use and
        kept for every draft path with the same base and format; None for ``model``.
        Returns (kernel, group, base ids, packed weight, scales) (:func:`~selfspec.draft.lowbit.quantize`)."""
        if weights == "model":
            return None
        key = (weights, group_size if weights == "int4" else 0, base.cpu().numpy().tobytes(),
               fit if weights == "int4" else "")
        if key not in self.copies:
            w = self.inner.weight.detach()
            rows = w if base.numel() == self.vocab else w.index_select(0, base.to(w.device))
            pad = -rows.shape[0] % 16  # torch's int4 kernel packs output rows in blocks of 16: zero rows, cut off again
            if pad:
                rows = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])])
            kernel, qweight, qscale = quantize(rows.contiguous(), weights, group_size, fit=fit)
            self.copies[key] = (kernel, key[1], base.to(w.device), qweight, qscale)
        return self.copies[key]

    def choice(self, ids: torch.Tensor, low: tuple | None = None) -> tuple:
        """What a request's draft scores: ``ids``, with ``low`` (a :meth:`copy_for` copy) scoring its base
        ids through quantized rows and only the other ids on bf16 rows. Returns the state :meth:`use` puts in
        place: (ids on bf16 rows, their rows, ``low``)."""
        if low is not None:
            base = low[2]
            ids = ids[~torch.isin(ids.to(base.device), base)]
        return ids, self.inner.weight.detach().index_select(0, ids).contiguous(), low

    def use(self, choice: tuple) -> None:
        """Score what :meth:`choice` chose (the head is shared by every draft path of the model: each path
        puts its own choice in place when it starts drafting)."""
        ids, rows, low = choice
        set_plain(self, ids=ids, rows=rows, low=low)

    def choose(self, ids: torch.Tensor, low: tuple | None = None) -> None:
        self.use(self.choice(ids, low))

    def _rescored(self, x2: torch.Tensor, low: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """``low`` [R, B] (the base ids' quantized logits for rows ``x2``) with each row's ``rescore`` highest
        replaced by their logits on the model's rows, as ``nn.Linear`` rounds them."""
        top = low.topk(min(self.rescore, low.shape[-1]), dim=-1).indices
        rows = self.inner.weight.detach()[base[top] if base.numel() != self.vocab else top]  # [R, rescore, E]
        exact = torch.matmul(rows, x2.unsqueeze(-1)).squeeze(-1)
        return low.scatter(-1, top, exact.to(low.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active or (self.ids is None and self.low is None):
            return self.inner(x)
        if self.low is not None:
            kernel, group, base, qweight, qscale = self.low
            x2 = x.reshape(-1, x.shape[-1])
            low = quantized_mm(x2, kernel, group, qweight, qscale)[:, :base.numel()]
            if self.rescore:
                low = self._rescored(x2, low, base)
            low = low.reshape(*x.shape[:-1], base.numel())
            if base.numel() == self.vocab:
                return low
        out = x.new_full((*x.shape[:-1], self.vocab), float("-inf"))
        if self.low is not None:
            out[..., base] = low
        if self.ids is not None and self.ids.numel():
            out[..., self.ids] = torch.nn.functional.linear(x, self.rows)
        return out
