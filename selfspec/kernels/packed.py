"""Linear weights prepacked for oneDNN, used by our decoding loop (a lean-loop option).

A one-token decode step is a chain of matrix-vector products, and on CPU the stock ``nn.Linear`` hands oneDNN a
plain row-major weight on every call. Reordering each bf16 weight once into oneDNN's blocked layout
(``torch.ops.mkldnn._reorder_linear_weight``) and calling ``torch.ops.mkldnn._linear_pointwise`` on it reads the same
bytes faster: on a 2-core Zen 4 one 1536x8960 product went from ~19 to ~26 GB/s of weights (docs/log.md). In bf16
the result is bit-identical to ``nn.Linear``'s, so decoding with packed weights emits the same tokens as without.

:func:`weight_packer` wraps every ``nn.Linear`` of *one* model instance in place with a :class:`PackedLinear` (no
transformers class is patched) and keeps the packed copies; they are used only inside ``with packer.packed():``,
which both of our decoding methods enter, so the autoregressive baseline and self-speculative decoding share the
same forward path. Outside the block every linear computes exactly as before (the transformers baselines in the same
process run the stock model). The copies are extra memory (:attr:`WeightPacker.extra_bytes`); only bf16 CPU weights.

oneDNN prepacks bf16 only on CPUs with AVX-512 (bw, vl, dq) or AVX-NE-CONVERT (:func:`packing_supported`). On others
(an AVX2-only CPU, e.g. a Zen 3 EPYC) the stock bf16 kernel is slow for one row and costs about as much per extra
row as for the first (a 6-row forward of the 1.5B ran 4.8x a one-row step there). There (:func:`pack_format`
``fp16``) each bf16 weight gets an fp16 copy, used for every input: the packed products read fp16 weights, accumulate
in fp32 and are rounded back to bf16. Our kernel computes them where it builds (:mod:`selfspec.kernels.fp16`: panels
of 16 outputs, read once for all rows of a forward); else fbgemm's, which reads the weights again for every 6 rows
(:func:`fp16_kernel` says which). The copy is taken only where it holds the bf16 values exactly (a
bf16 value below 2**-17 may not fit fp16's subnormals; Qwen2.5-Coder-1.5B has none); a weight that does not fit keeps
its bf16 values in our kernel's panels (the same sums, so verifies stay row-invariant), or gets an fp32 copy for
oneDNN's fp32 kernel under fbgemm. The results are the stock kernel's numbers up to the order of the sums. The copies
take the bf16 weights' memory again. Without fbgemm (``fp32``) every weight gets the fp32 copy, used for inputs of
:data:`FP32_MIN_ROWS` rows or more, at twice the bf16 weights' memory. Each method records which kernels it ran on
(``kernels``), and a line on stderr says so once. On a CPU with AMX (a Xeon) or AVX-512 BF16 (a Zen 4) the bf16
weights go into our kernel's VNNI panels (``amx``, :mod:`selfspec.kernels.amx`: AMX tiles, or AVX-512's bf16 dot
product), or where it does not run on an AMX CPU get fp16 copies on our fp16 kernel's AVX-512 build; a prefill's
products go to oneDNN (:data:`PREFILL_MIN_ROWS`). ``SELFSPEC_PACK=bf16|fp16|amx`` asks for one.

``keep_dense=False`` frees the dense weights once packed; only the packed copies of weights that must stay dense are
then extra: a weight shared with another module (tied embeddings) and the LM head's, whose rows the draft's cut head
gathers per request. The model then computes on the packed weights everywhere (the same results), and ``weight``
rebuilds a dense weight exactly from the packed copy when something reads it. As transformers maps the checkpoint file
into memory, the other tensors are then copied out of it so that the mapping and the freed weights' pages can go.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.kernels import amx, fp16, widths
from selfspec.model.wrap import copy_out_of_checkpoint, instance_state, wrap_descendants


@functools.cache
def packing_supported() -> bool:
    """Whether oneDNN can prepack bf16 weights on this CPU (it needs AVX-512 bw/vl/dq or AVX-NE-CONVERT).

    Asked of oneDNN itself, once per process, by packing a tiny weight: the rule is oneDNN's, not ours to copy.
    """
    return _can_reorder(torch.bfloat16)


def _can_reorder(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a weight of this dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def fbgemm_fp16() -> bool:
    """Whether fbgemm's fp16 linear kernel (prepacked fp16 weights, fp32 activations) runs here."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        torch.ops.quantized.linear_dynamic_fp16(torch.zeros(1, 8), torch.ops.quantized.linear_prepack_fp16(
            torch.zeros(8, 8), None))
    except (RuntimeError, AttributeError):
        return False
    return True


PACK_ENV = "SELFSPEC_PACK"  # bf16, fp16 or amx: the full model's packing whatever the CPU (where it runs)


@functools.cache
def pack_format() -> str | None:
    """How bf16 weights are packed here: ``amx`` (our bf16 VNNI panels on AMX tiles or AVX-512 BF16,
    :mod:`selfspec.kernels.amx`) where they run and oneDNN packs bf16, else ``bf16`` where oneDNN packs them; else
    ``fp16`` (exact fp16 copies, on our kernel or fbgemm's: :func:`fp16_kernel`; also on an AMX CPU where our AMX
    kernel does not run) or, without fbgemm, ``fp32`` (copies for oneDNN's fp32 kernel, for :data:`FP32_MIN_ROWS` rows
    or more); None with neither. :data:`PACK_ENV` may ask for one."""
    asked = os.environ.get(PACK_ENV, "")
    if asked not in ("", "bf16", "fp16", "amx"):
        raise SelfSpecError(f"{PACK_ENV}={asked}: bf16 (oneDNN), fp16 (exact fp16 copies) or amx, or unset")
    if asked == "amx" and not amx.available():
        raise SelfSpecError(f"{PACK_ENV}=amx: our AMX kernel does not run here ({amx.unavailable_reason()})")
    if asked == "amx" or (not asked and packing_supported() and amx.available()):
        return "amx"  # one-row steps faster than on the fp16 panels (AMX) and on oneDNN's bf16 (docs/kernels.md)
    if asked == "fp16" or (not asked and packing_supported() and amx.cpu_has_amx()):
        return "fp16"  # on AMX: our panels' one-row products beat oneDNN's bf16 ones (docs/kernels.md)
    if packing_supported():
        return "bf16"
    if fbgemm_fp16():
        return "fp16"
    return "fp32" if _can_reorder(torch.float32) else None


def fp16_kernel() -> str | None:
    """Which kernel computes the fp16 copies (where :func:`pack_format` is ``fp16``): ``panels r<n>`` (ours,
    :mod:`selfspec.kernels.fp16`: it reads the weights once for up to 16 rows) where it runs, else ``fbgemm``; None
    where the weights are not packed as fp16."""
    if pack_format() != "fp16":
        return None
    return fp16.label() if fp16.available() else "fbgemm"


def pack_label() -> str | None:
    """:func:`pack_format`, with our kernel's name where it computes the copies (``fp16 panels r1``, ``amx r1``):
    what records and machine fingerprints say, so runs and cost models of two kernels never mix."""
    if pack_format() == "amx":
        return amx.label()
    kernel = fp16_kernel()
    return f"fp16 {kernel}" if kernel not in (None, "fbgemm") else pack_format()


def default_rows() -> int:
    """Our loop's full-model forwards' padded width (``DecodeConfig.rows``): :func:`bf16_rows` on oneDNN's bf16, else 1."""
    return bf16_rows() if pack_format() == "bf16" else 1


def bf16_rows() -> int:
    """6 where a one-row product on oneDNN's bf16 packs takes other bits than wider ones (a Zen 4), else 1."""
    return 1 if widths.one_row_exact() else 6


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this weight gets a packed copy: bf16 on a CPU with oneDNN."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and pack_format() is not None


# PackedLinear's kinds -> what records call them
KERNELS = {"bf16": "packed", "fp16": "packed fp16", "fp32": "packed fp32", "amx": "packed amx", None: "stock"}
PACK_KINDS = tuple(k for k in KERNELS if k)
# fp32 copies serve inputs of this many rows or more; fewer go through the stock bf16 kernel, faster there (the 1.5B
# on a 2-core Zen 3, scripts/verify_width.py: stock 1.75x a one-row step at 2 rows, the copies 2.01x; docs/log.md)
FP32_MIN_ROWS = 3
# our kernels' products of this many rows or more (prefills) run on oneDNN's stock kernel, faster there (docs/kernels.md)
PREFILL_MIN_ROWS = {"fp16": 64, "amx": 1024}


def kernels_label(packed: bool, kind: str | None = None) -> str:
    """What a method computes on: ``packed`` (our prepacked bf16 weights), ``packed fp16`` / ``packed fp32``
    (fp16 or fp32 copies, on a CPU that cannot pack bf16; ``packed fp16 panels r1`` where our fp16 kernel computes
    them), ``packed amx r1`` or ``stock`` (the model as loaded). ``kind``: a packing asked for, not this CPU's."""
    if not packed:
        return "stock"
    if kind not in (None, pack_format()):
        return f"packed {amx.label()}" if kind == "amx" else (
            f"packed fp16 {fp16.label()}" if kind == "fp16" and fp16.available() else KERNELS[kind])
    label = pack_label()
    return KERNELS[pack_format()] if label == pack_format() else f"packed {label}"


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
    """An ``nn.Linear`` that also keeps its weight prepacked, used while ``active``.

    ``kind``: ``bf16`` (oneDNN's layout), ``fp16`` (an exact fp16 copy, in our kernel's panels where ``panels``,
    else prepacked for fbgemm), ``fp32`` (an fp32 copy for oneDNN) or ``amx`` (the bf16 weight in our AMX kernel's
    panels), as :func:`pack_format` says or ``kind`` asks.
    A weight that fp16 does not hold exactly is ``bf16 panels`` where our kernel runs (its bf16 values in the same
    panels: the same row-invariant sums), else ``fp32``. Without its dense weight it computes on the packed one.
    """

    def __init__(self, inner: nn.Linear, pinned: bool = False, kind: str | None = None) -> None:
        super().__init__(inner)
        w = inner.weight.detach()
        if kind not in (None, *PACK_KINDS):
            raise ValueError(f"packed kind {kind!r}: one of {PACK_KINDS}")
        self.kind = kind or pack_format()
        wide = w.float() if self.kind in ("fp16", "fp32") else None  # converted once: the 1.5B's head is 0.9 GB in fp32
        # our kernel's layout (selfspec.kernels.fp16): this CPU's fp16 kernel, or ours where fp16 is asked for
        self.panels = self.kind == "fp16" and (fp16.available() if kind else fp16_kernel() != "fbgemm")
        # prefills: oneDNN's stock kernel from these rows, where it packs bf16 (self.kind is "fp16" or "amx" here)
        self.stock_from = PREFILL_MIN_ROWS[self.kind] if (self.panels or self.kind == "amx") and packing_supported() else None
        if self.kind == "fp16" and not torch.equal(w.half().float(), wide):
            self.kind = "bf16 panels" if self.panels else "fp32"
        self.bias32 = None if inner.bias is None else inner.bias.detach().float().contiguous()
        if self.kind == "amx":
            self.packed = amx.pack(w)
        elif self.panels:
            self.packed = fp16.pack(w, torch.bfloat16 if self.kind == "bf16 panels" else torch.float16)
        elif self.kind == "fp16":  # fbgemm keeps the bias in the packed object
            self.packed = torch.ops.quantized.linear_prepack_fp16(wide, self.bias32)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w if wide is None else wide, 1)
        # bf16: the width each product runs at so that its rows get the bits they get in any other (widths.py)
        bias = None if inner.bias is None else inner.bias.detach()
        self.widths = () if self.kind != "bf16" else widths.pad_table(
            self.packed, bias, self.out_features, self.in_features, bf16_rows())
        self.dense = True
        self.pinned = pinned  # the dense weight must stay (shared with another module, or the LM head's)
        self.requires_grad = inner.weight.requires_grad

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight if self.dense else self._from_packed()

    def _from_packed(self) -> torch.Tensor:
        if self.kind == "amx":
            return amx.unpack(self.packed, self.out_features, self.in_features)
        if self.panels:
            return fp16.unpack(self.packed, self.out_features).to(torch.bfloat16)  # exact
        if self.kind == "fp16":
            return torch.ops.quantized.linear_unpack_fp16(self.packed)[0].to(torch.bfloat16)  # exact
        w = self.packed.to_dense()
        return w.to(torch.bfloat16) if self.kind == "fp32" else w  # bf16 -> fp32 -> bf16 is exact

    @property
    def extra_bytes(self) -> int:
        """The packed copy's size while the dense weight is kept too, else 0."""
        if not self.dense:
            return 0
        if self.kind == "fp16" and not self.panels:
            return self.in_features * self.out_features * 2
        return self.packed.numel() * self.packed.element_size()

    def drop_dense(self) -> None:
        if self.dense and not self.pinned:
            del self.inner.weight
            self.dense = False

    def restore_dense(self) -> None:
        if not self.dense:
            self.inner.weight = nn.Parameter(self._from_packed(), requires_grad=self.requires_grad)
            self.dense = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active and self.dense:
            return self.inner(x)
        if self.stock_from and self.dense and x.numel() >= self.stock_from * x.shape[-1]:
            return self.inner(x)  # a prefill's rows, where oneDNN packs bf16: its kernel is faster there
        if self.kind == "amx":
            return amx.linear(x, self.packed, self.bias32, self.out_features)
        if self.panels:
            return fp16.linear(x, self.packed, self.bias32, self.out_features)
        if self.kind == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)
        bias = self.inner.bias
        bias = None if bias is None else bias.detach()
        if self.kind == "bf16":
            return widths.padded(widths.mkldnn_product(self.packed, bias), x, self.widths)
        if self.dense and x.numel() < FP32_MIN_ROWS * x.shape[-1]:  # the stock bf16 kernel is faster here
            return self.inner(x)
        y = torch.ops.mkldnn._linear_pointwise(x.float(), self.packed, None if bias is None else bias.float(),
                                               "none", [], "")
        return y.to(x.dtype)


class WeightPacker:
    """Owns the :class:`PackedLinear` wrappers of one model; switch them on with :meth:`packed`. ``kind``: the
    packing of all of them (:class:`PackedLinear`), None for this CPU's; the packing they got, as ``kind``."""

    def __init__(self, model: nn.Module, keep_dense: bool = True, kind: str | None = None) -> None:
        self.model = model
        self.keeps_dense = keep_dense
        self.kind = kind or pack_format()
        self.linears: list[PackedLinear] = _wrap(model, keep_dense, kind)
        if not packing_supported() and any(p.dtype == torch.bfloat16 and p.device.type == "cpu"
                                           for p in model.parameters()):
            _say_unpacked()
        self.depth = 0
        if not keep_dense:
            copy_out_of_checkpoint(model)

    @property
    def extra_bytes(self) -> int:
        return sum(lin.extra_bytes for lin in self.linears)

    def keep_dense(self, keep: bool) -> None:
        """Keep the dense weights beside the packed ones (the model as loaded outside :meth:`packed`) or free them."""
        if keep != self.keeps_dense:
            for lin in self.linears:
                if keep:
                    lin.restore_dense()
                else:
                    lin.drop_dense()
            if not keep:
                copy_out_of_checkpoint(self.model)
            self.keeps_dense = keep

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


@functools.cache
def _say_unpacked() -> None:
    how = {
        "fp16": "packed forwards run on exact fp16 copies of the bf16 weights (their memory again), "
                + ("in panels for our kernel (selfspec.kernels.fp16)" if fp16_kernel() != "fbgemm" else
                   f"prepacked for fbgemm (our fp16 kernel: {fp16.unavailable_reason()})"),
        "fp32": "packed forwards over 3 or more rows run on fp32 copies of the bf16 weights, prepacked for oneDNN "
                "(twice their memory); 1-2 row steps on the stock bf16 kernel",
    }.get(pack_format(), "every method runs on the stock kernels")
    print(f"[selfspec] this CPU ({torch.backends.cpu.get_cpu_capability()}) cannot prepack bf16 weights for oneDNN "
          f"(that needs AVX-512 or AVX-NE-CONVERT): {how}", file=sys.stderr)


def _wrap(model: nn.Module, keep_dense: bool, kind: str | None = None) -> list[PackedLinear]:
    """Wraps every packable linear of ``model``; without ``keep_dense`` frees each dense weight that may go.

    Also looks inside other wrappers (skippable sublayers, draft linears, the cut head).
    """
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_weight = head.weight if head is not None else None
    linears = wrap_descendants(
        model, PackedLinear,
        match=lambda m: isinstance(m, nn.Linear) and can_pack(m.weight),
        make=lambda m: PackedLinear(m, pinned=counts[id(m.weight)] > 1 or m.weight is head_weight, kind=kind),
    )
    if not keep_dense:
        for lin in linears:
            lin.drop_dense()
    return linears


_PACKER_ATTR = "_selfspec_packer"


def weight_packer(model: nn.Module, keep_dense: bool | None = None, kind: str | None = None) -> WeightPacker:
    """The :class:`WeightPacker` of ``model``, packing its linears on first use (a few seconds for 1.5B).

    ``keep_dense``: keep (True) or free (False) the dense weights beside the packed
    ones; None leaves them as they are (kept, when packing now). ``kind``: the packing, when packing now
    (:class:`PackedLinear`); a model already packed another way is an error.
    """
    packer = instance_state(model, _PACKER_ATTR, lambda: WeightPacker(model, keep_dense is not False, kind))
    if kind is not None and packer.kind != kind:
        raise ValueError(f"this model's weights are packed as {packer.kind}, not {kind}")
    if keep_dense is not None:
        packer.keep_dense(keep_dense)  # nothing to do when they already are
    return packer


@contextmanager
def packed_weights(model: nn.Module, on: bool = True, only: bool | None = None) -> Iterator[None]:
    """Run ``model`` on its packed weights inside the block (packing them on first use).

    ``only``: free (True) or keep (False) the dense weights; None: as they are.
    ``on=False``: the weights as loaded (dense weights freed before are rebuilt).
    """
    if not on:
        packer = model.__dict__.get(_PACKER_ATTR)
        if packer is not None:
            packer.keep_dense(True)
        yield
        return
    with weight_packer(model, None if only is None else not only).packed():
        yield
