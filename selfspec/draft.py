"""A cheaper draft through the same model: fewer sublayers, lower-precision weights, a cut LM head.

Self-speculative drafting runs the target model with the plan's sublayers
skipped. :class:`DraftPath` makes each draft step cheaper still, without a
second model and without touching what verification computes:

- ``weights: int8 | int4``: the linear layers of the *kept* sublayers get a
  weight-only quantized copy (int8 with one scale per output row, through
  ``torch.ops.aten._weight_int8pack_mm``; int4 with asymmetric groups of
  ``group_size``, through ``_weight_int4pack_mm_for_cpu``) used only while
  drafting. Decode steps are memory-bound, so reading a half or a quarter of
  the bytes makes a draft step about that much cheaper. The copies are extra
  memory and are reported (:attr:`DraftPath.extra_bytes`).
- ``head_tokens: N``: while drafting, the LM head scores only N token ids (the
  lowest ids, which byte-pair merge order makes the most frequent ones, plus
  the prompt's own tokens and the stop tokens); the others get ``-inf``.
  The full head of a 150k-token vocabulary costs as much as a few layers.
- ``ngram: n``: when the last n tokens occurred earlier in the context, the
  round drafts by copying what followed them (prompt lookup, :class:`NGramIndex`),
  up to ``copy_tokens`` tokens (default: k), and runs no draft forward at all.

Both are switched on only inside ``with path.drafting():`` (together with the
skip plan) by wrapping modules of *that* model instance in place, as
:mod:`selfspec.skip` does; outside the block every module computes exactly
what it computed before. Verification stays the full model, so greedy output
is unchanged and sampling keeps the target distribution: the draft only
proposes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Iterator

import torch
from torch import nn

from .errors import SelfSpecError
from .packed import LinearWrapper, PackedLinear
from .plan import SkipPlan
from .skip import layer_skipper

WEIGHTS = ("model", "int8", "int4")


@dataclass(frozen=True)
class DraftOptions:
    weights: str = "model"  # model | int8 | int4: precision of the kept linears while drafting
    group_size: int = 32  # int4 quantization group (along the input dimension)
    head_tokens: int = 0  # 0 = the full LM head while drafting; N = N token ids + prompt + stop tokens
    ngram: int = 0  # 0 = off; n >= 1: draft by copying what followed the last n tokens in the context
    copy_tokens: int = 0  # longest copy draft; 0 = k, like the layer-skip draft

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS:
            raise SelfSpecError(f"draft weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.head_tokens < 0 or self.ngram < 0 or self.copy_tokens < 0:
            raise SelfSpecError("head_tokens, ngram and copy_tokens must be >= 0")
        if self.weights == "int4" and self.group_size not in (32, 64, 128, 256):
            raise SelfSpecError(f"int4 group_size must be 32, 64, 128 or 256, got {self.group_size}")

    @property
    def plain(self) -> bool:
        return self.weights == "model" and self.head_tokens == 0

    def record(self) -> dict | None:
        """The options as a run records them (None for the plan-only draft).

        ``copy_tokens`` appears only when set, so runs recorded before it existed still resume.
        """
        if self.plain and not self.ngram:
            return None
        rec = asdict(self)
        if not self.copy_tokens:
            del rec["copy_tokens"]
        return rec


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(w.dtype)


def _quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    if k % group:
        raise SelfSpecError(f"int4 needs in_features ({k}) divisible by group_size ({group})")
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-8)
    q = torch.round((wg - lo) / scale).clamp(0, 15).reshape(n, k).to(torch.int32)
    zero = lo + 8.0 * scale  # the kernel computes (q - 8) * scale + zero
    sz = torch.stack([scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1).to(w.dtype).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    return packed, sz


class LowPrecisionLinear(LinearWrapper):
    """An ``nn.Linear`` (or its PackedLinear) with a weight-only quantized copy used while ``active``."""

    def __init__(self, inner: nn.Module, weights: str, group_size: int) -> None:
        super().__init__(inner)
        self.kind, self.group = "", 0
        self.configure(weights, group_size)

    def configure(self, weights: str, group_size: int) -> None:
        """(Re)build the quantized copy unless it already has this format."""
        if (self.kind, self.group) == (weights, group_size) or (self.kind == weights == "int8"):
            return
        self.kind, self.group = weights, group_size
        w = self.inner.weight.detach()
        if weights == "int8":
            self.qweight, self.qscale = _quantize_int8(w)
        else:
            self.qweight, self.qscale = _quantize_int4(w, group_size)

    @property
    def extra_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.qscale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.inner(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2, self.qweight, self.qscale)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.qscale)
        if self.inner.bias is not None:
            y = y + self.inner.bias
        return y.reshape(*shape[:-1], self.out_features)


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


class DraftPath:
    """The draft-only state of one model for one plan: skips, quantized copies, cut head."""

    def __init__(self, model: nn.Module, plan: SkipPlan, options: DraftOptions, stop_ids=()) -> None:
        self.model = model
        self.plan = plan
        self.options = options
        self.skipper = layer_skipper(model)
        plan.check_model(self.skipper.num_layers)
        self.linears: list[LowPrecisionLinear] = []
        if options.weights != "model":
            if next(model.parameters()).device.type != "cpu":
                raise SelfSpecError("int8/int4 draft weights use CPU kernels; use weights=model on other devices")
            skipped = [(self.skipper.attn, set(plan.attn)), (self.skipper.mlp, set(plan.mlp))]
            for subs, off in skipped:
                for i, sub in enumerate(subs):
                    if i not in off:
                        self.linears += _wrap_linears(sub.inner, options)
        self.head: CutHead | None = None
        self.base_ids: torch.Tensor | None = None
        if options.head_tokens:
            head = model.get_output_embeddings()
            if not isinstance(head, CutHead):
                head = CutHead(head)
                model.set_output_embeddings(head)
            self.head = head
            vocab = head.inner.out_features
            base = set(range(min(options.head_tokens, vocab))) | {int(i) for i in stop_ids if 0 <= int(i) < vocab}
            self.base_ids = torch.tensor(sorted(base), dtype=torch.long)

    @property
    def extra_bytes(self) -> int:
        """Memory the draft path keeps beside the model: quantized copies, the cut head's rows.

        Before the first request the head's rows are counted for the base ids
        (a request adds its prompt's tokens).
        """
        head = 0
        if self.head is not None:
            w = self.head.inner.weight
            rows = self.head.rows.shape[0] if self.head.rows is not None else self.base_ids.numel()
            head = rows * w.shape[1] * w.element_size()
        return sum(lin.extra_bytes for lin in self.linears) + head

    def prepare(self, prompt: torch.Tensor) -> None:
        """Per request: the cut head also scores the prompt's tokens (copying them is common)."""
        if self.head is not None:
            ids = torch.cat([self.base_ids.to(prompt.device), prompt.reshape(-1)]).unique()
            self.head.choose(ids)

    @contextmanager
    def drafting(self) -> Iterator[None]:
        with self.skipper.skipping(self.plan):
            try:
                for lin in self.linears:
                    lin.active = True
                if self.head is not None:
                    self.head.active = True
                yield
            finally:
                for lin in self.linears:
                    lin.active = False
                if self.head is not None:
                    self.head.active = False


def _wrap_linears(module: nn.Module, options: DraftOptions) -> list[LowPrecisionLinear]:
    out = []
    for name, child in list(module.named_children()):
        if isinstance(child, LowPrecisionLinear):
            child.configure(options.weights, options.group_size)
            out.append(child)
        elif isinstance(child, (nn.Linear, PackedLinear)):  # a packed linear stays inside the draft's copy
            wrapped = LowPrecisionLinear(child, options.weights, options.group_size)
            setattr(module, name, wrapped)
            out.append(wrapped)
        else:
            out += _wrap_linears(child, options)
    return out


class NGramIndex:
    """Where each n-gram of the context last occurred, for copy drafting (prompt lookup)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end > self.n:  # the n-gram before the newest token now has a continuation
                self.last[tuple(self.tokens[end - 1 - self.n : end - 1])] = end - 1

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens."""
        if len(self.tokens) < self.n:
            return []
        start = self.last.get(tuple(self.tokens[-self.n :]))
        if start is None:
            return []
        return self.tokens[start : start + k]
