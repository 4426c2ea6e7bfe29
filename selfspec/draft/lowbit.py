"""Weight-only quantized copies of linear layers, used while drafting.

:class:`LowPrecisionLinear` wraps an ``nn.Linear`` (or its :class:`~selfspec.kernels.packed.PackedLinear`)
of one model instance in place and keeps an int8 (one scale per output row,
``torch.ops.aten._weight_int8pack_mm``) or int4 (asymmetric groups of
``group_size`` along the input dimension, ``_weight_int4pack_mm_for_cpu``) copy
of its weight. The copy is used only while ``active``; otherwise the layer
computes exactly what the wrapped one computes. Decode steps are bound by
reading weights, so a half or a quarter of the bytes makes a draft step about
that much cheaper.

An int4 copy of a bf16 weight runs on :mod:`selfspec.kernels.vnni` (int8 activations, integer products on
AVX-512 VNNI, or AVX2 + FMA; the same int4 values in another layout) where that kernel runs and takes the shape, else on torch's
kernel. Each copy carries the name of the kernel it was laid out for (:func:`quantize`).

Linears of one module that read the same input (:data:`SIBLINGS`: an attention's q/k/v, an MLP's gate/up) share
one copy stacked along the output rows where the kernel allows it (:data:`STACKABLE`), and one product serves them
all while drafting (:class:`SharedInput`): fewer, wider calls, each of which has a fixed cost besides its weights
(rounding the activations, allocating, starting the threads). Each output row is computed as it would be alone,
so the draft's numbers do not change.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from selfspec.errors import SelfSpecError
from selfspec.kernels import hugepages, vnni
from selfspec.kernels.packed import LinearWrapper, PackedLinear
from selfspec.model.wrap import set_plain, wrap_descendants


def _quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.to(w.dtype)


FITS = ("minmax", "lsq", "grid", "lsq3", "lsq2")  # how an int4 group's scale and zero are chosen (DraftOptions.int4_fit)
# fits that give each group fewer of the 16 levels: what 3- or 2-bit weights would make the draft accept, computed on
# the int4 kernel at its cost (a measurement for the route bounds, selfspec.inspect.route_bounds; no kernel here reads
# fewer bits); a draft's quantized head keeps 16 levels (selfspec.draft.path)
FEWER_LEVELS = {"lsq3": 8, "lsq2": 4}
LSQ_ROUNDS = 4  # refinements of the least-squares fit; each group keeps its smallest error seen
# a group lies on a 4-bit grid when its distinct values are at most 16 even steps apart, each within this
# fraction of a step of its level (a bf16 copy of 4-bit values is off by at most 2^-9 of a value: far less)
GRID_TOLERANCE = 0.125
# weights fitted at a time: ~2 MiB in fp32, which the fits' many elementwise passes find in cache (a 150k-row
# head at once would take gigabytes)
_CHUNK = 1 << 19


def _int4_groups(w: torch.Tensor, group: int, fit: str = "minmax") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 groups of ``group`` inputs: values q [N, K] in 0..15, scale and zero [N, K/group], with
    weight = (q - 8) * scale + zero (the form torch's int4 kernel computes).

    ``fit``: ``minmax`` spans each group's range in 16 even steps; ``lsq`` starts there and refits each group's
    step and offset to its weights by least squares given its values, then rounds again, :data:`LSQ_ROUNDS`
    times, keeping per group the fit with the smallest squared error (never worse than ``minmax``'s); ``lsq3`` and
    ``lsq2`` do the same on 8 and 4 levels (:data:`FEWER_LEVELS`: values 0..7 and 0..3); ``grid``
    gives a group that lies on a 4-bit grid of its own (:func:`_on_grid`) that grid, and every other group the
    ``lsq`` fit: a checkpoint dequantized from 4-bit blocks of ``group`` inputs (GGUF's Q4_K and Q4_1 blocks of
    32) gets its own values back, up to their bf16 rounding; wider groups, whose blocks have steps of their own,
    get ``lsq``'s."""
    n, k = w.shape
    if k % group:
        raise SelfSpecError(f"int4 needs in_features ({k}) divisible by group_size ({group})")
    if fit not in FITS:
        raise SelfSpecError(f"int4 fit must be one of {', '.join(FITS)}, got {fit!r}")
    top = FEWER_LEVELS.get(fit, 16) - 1  # the highest value
    qs, scales, zeros = [], [], []
    rows = max(1, _CHUNK // k)
    for r0 in range(0, n, rows):
        wg = w[r0:r0 + rows].float().reshape(-1, k // group, group)
        lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
        step = ((hi - lo) / top).clamp(min=1e-8)
        q = torch.round((wg - lo) / step).clamp(0, top)
        if fit.startswith("lsq"):
            q, step, lo = _refit(wg, q, step, lo, top)
        elif fit == "grid":
            gq, ga, gb, on = _on_grid(wg)
            off = ~on.squeeze(-1)
            if off.any():  # the lsq fit where a group is off any grid (every group of a 6-bit block, say)
                q[off], step[off], lo[off] = _refit(wg[off], q[off], step[off], lo[off])
            q, step, lo = torch.where(on, gq, q), torch.where(on, ga, step), torch.where(on, gb, lo)
        qs.append(q.reshape(-1, k).to(torch.int32))
        scales.append(step.squeeze(-1))
        zeros.append((lo + 8.0 * step).squeeze(-1))
    return torch.cat(qs), torch.cat(scales), torch.cat(zeros)


def _line(wg: torch.Tensor, wm: torch.Tensor, v: torch.Tensor, fallback) -> tuple[torch.Tensor, torch.Tensor]:
    """The least-squares step and offset (a, b) of groups ``wg`` [R, G, group] (their means ``wm``) on levels ``v``,
    wg ~ a v + b; the step ``fallback`` where a group's levels are all one."""
    vm = v.mean(-1, keepdim=True)
    var = ((v - vm) ** 2).sum(-1, keepdim=True)
    a = torch.where(var > 0, ((v - vm) * (wg - wm)).sum(-1, keepdim=True) / var.clamp(min=1e-12), fallback).clamp(min=1e-8)
    return a, wm - a * vm


def _refit(wg: torch.Tensor, q: torch.Tensor, step: torch.Tensor, lo: torch.Tensor, top: int = 15) -> tuple:
    """The ``lsq`` fit of groups ``wg`` [R, G, group] from the values ``q`` = round((wg - lo) / step) in 0..``top``."""
    best = ((q * step + lo - wg) ** 2).sum(-1, keepdim=True)
    wm = wg.mean(-1, keepdim=True)
    a, b, v = step, lo, q
    for _ in range(LSQ_ROUNDS):
        a, b = _line(wg, wm, v, a)
        v = torch.round((wg - b) / a).clamp(0, top)
        err = ((v * a + b - wg) ** 2).sum(-1, keepdim=True)
        better = err < best
        q, step, lo = torch.where(better, v, q), torch.where(better, a, step), torch.where(better, b, lo)
        best = torch.minimum(err, best)
    return q, step, lo


def _on_grid(wg: torch.Tensor) -> tuple:
    """Groups ``wg`` [R, G, group] that lie on a 4-bit grid of their own: (levels, step, offset, on) with ``on``
    [R, G, 1] true where a group's values lie on at most 16 even steps from its least value, each within
    :data:`GRID_TOLERANCE` of a step of its level.

    The number of steps across a group's range is about its span over the smallest gap between two of its
    distinct values; bf16 rounding moves that gap by up to a few percent of a step where the values are large
    beside it, so the count and one on either side are tried: for each, the values take levels on span / count
    and the step and offset are fitted to those levels by least squares (which averages out most of the
    rounding); the count whose worst value lies closest to its level wins."""
    lo = wg.amin(-1, keepdim=True)
    span = wg.amax(-1, keepdim=True) - lo
    gaps = wg.sort(-1).values.diff(dim=-1)
    # gaps within one level are 0 for a bf16 copy of a 4-bit block; those under span / 64 are taken for rounding
    gap = torch.where(gaps > span / 64, gaps, torch.full_like(gaps, float("inf"))).amin(-1, keepdim=True)
    guess = torch.where(torch.isfinite(gap), torch.round(span / gap), torch.ones_like(gap))  # one value: 1 step
    wm = wg.mean(-1, keepdim=True)
    best = None
    for steps in (guess, guess - 1, guess + 1):
        v = torch.round((wg - lo) / (span / steps.clamp(min=1)).clamp(min=1e-12))
        a, b = _line(wg, wm, v, 1.0)
        worst = torch.where((steps >= 1) & (steps <= 15), ((v * a + b - wg).abs() / a).amax(-1, keepdim=True), torch.inf)
        if best is None:
            best = [v, a, b, worst]
        else:
            take = worst < best[3]
            best = [torch.where(take, new, old) for new, old in zip((v, a, b, worst), best)]
    v, a, b, worst = best
    return v, a, b, worst <= GRID_TOLERANCE


def group_width(model: nn.Module) -> int:
    """The widest int4 group every linear layer of ``model`` can take: its inputs' greatest common divisor (a
    group size must divide it, :func:`_int4_groups`)."""
    return math.gcd(*(m.in_features for m in model.modules() if isinstance(m, nn.Linear)))


def _quantize_int4(w: torch.Tensor, group: int, fit: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    q, scale, zero = _int4_groups(w, group, fit)
    sz = torch.stack([scale.t(), zero.t()], dim=-1).to(w.dtype).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2), sz


def int4_kernel(w: torch.Tensor, group: int) -> str:
    """The kernel an int4 copy of ``w`` runs on: ``int4-vnni`` (:mod:`selfspec.kernels.vnni`) for a bf16 CPU weight
    it takes where it runs, else ``int4`` (torch's ``_weight_int4pack_mm_for_cpu``)."""
    if w.dtype == torch.bfloat16 and w.device.type == "cpu" and vnni.fits(w.shape[1], group) and vnni.available():
        return "int4-vnni"
    return "int4"


def quantize(w: torch.Tensor, kind: str, group: int, kernel: str | None = None,
             fit: str = "minmax", place: bool = True) -> tuple[str, torch.Tensor, torch.Tensor]:
    """A weight-only quantized copy of ``w`` ``[out, in]``: (kernel, packed weight, scales) for :func:`quantized_mm`.

    ``kind``: int8 | int4; ``kernel`` (int4 only): ``int4`` (torch's) or ``int4-vnni``; default :func:`int4_kernel`;
    ``fit`` (int4 only): :func:`_int4_groups`; ``place``: an ``int4-vnni`` copy goes on huge pages now
    (:func:`selfspec.kernels.vnni.pack`).
    """
    if kind == "int8":
        return ("int8", *_quantize_int8(w))
    kernel = kernel or int4_kernel(w, group)
    if kernel == "int4-vnni":
        q, scale, zero = _int4_groups(w, group, fit)
        return ("int4-vnni", *vnni.pack(q, torch.stack([scale, zero], dim=-1), place=place))
    return ("int4", *_quantize_int4(w, group, fit))


def quantized_mm(x2: torch.Tensor, kernel: str, group: int, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """``x2 @ w.T`` for a 2-D ``x2`` through the copy :func:`quantize` made for ``kernel`` (no bias)."""
    if kernel == "int8":
        return torch.ops.aten._weight_int8pack_mm(x2, qweight, qscale)
    if kernel == "int4-vnni":
        return vnni.mm(x2, qweight, qscale, group)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, qweight, group, qscale)


def copy_key(weights: str, group_size: int, fit: str = "minmax") -> tuple:
    """The key of a copy in this format (int8 has no groups; an int4 fit other than ``minmax`` is a third part):
    :attr:`LowPrecisionLinear.copies`, stacked copies."""
    if weights == "int8":
        return weights, 0
    return (weights, group_size) if fit == "minmax" or weights != "int4" else (weights, group_size, fit)


def _nbytes(copy: tuple[str, torch.Tensor, torch.Tensor]) -> int:
    """The bytes a copy (kernel, packed weight, scales) holds."""
    return sum(t.numel() * t.element_size() for t in copy[1:])


# names of linears of one module that read the same input, by architecture convention (Llama, Qwen2, Gemma3)
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
STACKABLE = ("int8", "int4-vnni")  # kernels whose copies stack along the output rows (torch's int4 layout does not)


class LowPrecisionLinear(LinearWrapper):
    """An ``nn.Linear`` (or its PackedLinear) with a weight-only quantized copy used while ``active``.

    Copies are kept per format, so that switching a model's draft between formats (as a search
    does from trial to trial) quantizes each weight once per format; only the copy in use counts
    as extra memory (:attr:`extra_bytes`), the others are held in :attr:`kept_bytes`.
    """

    def __init__(self, inner: nn.Module, weights: str, group_size: int, fit: str = "minmax", place: bool = True) -> None:
        super().__init__(inner)
        self.key: tuple | None = None
        self.kind, self.group, self.kernel = "", 0, ""
        self.copies: dict[tuple, tuple[str, torch.Tensor, torch.Tensor]] = {}
        self.shared: SharedInput | None = None  # the siblings this linear shares its input and products with
        self.rows = slice(0, self.out_features)  # its output rows in the siblings' stacked product
        self.configure(weights, group_size, fit, place)

    def configure(self, weights: str, group_size: int, fit: str = "minmax", place: bool = True) -> None:
        """Use the copy in this format, quantizing the weight on first use (a draft round calls this for every
        kept linear: the format in use already costs one comparison); ``place``: as :func:`quantize`'s."""
        key = copy_key(weights, group_size, fit)
        if key == self.key:
            return
        if key not in self.copies:
            w = self.inner.weight.detach()
            self.copies[key] = quantize(w, weights, group_size, fit=fit, place=place)
        kernel, qweight, qscale = self.copies[key]
        set_plain(self, key=key, kind=key[0], group=key[1], kernel=kernel, qweight=qweight, qscale=qscale)

    @property
    def extra_bytes(self) -> int:
        """The copy in use."""
        return _nbytes(self.copies[self.key])

    def copy(self, weights: str, group_size: int, fit: str = "minmax") -> tuple[str, torch.Tensor, torch.Tensor]:
        """The copy in this format (made by :meth:`configure`): (kernel, packed weight, scales)."""
        return self.copies[copy_key(weights, group_size, fit)]

    def copy_bytes(self, weights: str, group_size: int, fit: str = "minmax") -> int:
        """The copy in this format (made by :meth:`configure`)."""
        return _nbytes(self.copy(weights, group_size, fit))

    @property
    def kept_bytes(self) -> int:
        """All copies held, the one in use included."""
        return sum(_nbytes(copy) for copy in self.copies.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return self.inner(x)
        shared = self.shared
        if shared is not None and self.key in shared.stacked:
            return shared.output(x, self.key)[..., self.rows]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = quantized_mm(x2, self.kernel, self.group, self.qweight, self.qscale)
        if self.inner.bias is not None:
            y = y + self.inner.bias
        return y.reshape(*shape[:-1], self.out_features)


class SharedInput:
    """Sibling linears (one module's, reading the same input) whose copies are stacked along the output rows: the
    first of them called on an input computes every sibling's output in one product; the others, called on that
    same tensor (same object, and, outside inference mode, not modified in place since), take their rows of it.

    A format is stacked (:meth:`stack`) when every sibling has its copy for a kernel in :data:`STACKABLE`; the
    siblings' own copies then become views of the stacked one, so it takes no extra memory.
    """

    def __init__(self, members: list[LowPrecisionLinear]) -> None:
        self.members = members
        # format -> (kernel, group, stacked weight, stacked scales, stacked bias or None)
        self.stacked: dict[tuple, tuple] = {}
        self.x: torch.Tensor | None = None
        self.version = -1
        self.y: torch.Tensor | None = None
        start = 0
        for m in members:
            m.shared, m.rows = self, slice(start, start + m.out_features)
            start += m.out_features

    def stack(self, key: tuple) -> None:
        """Stack the siblings' copies in format ``key`` where their kernel allows it (once per format)."""
        if key in self.stacked or any(key not in m.copies for m in self.members):
            return
        copies = [m.copies[key] for m in self.members]
        kernel = copies[0][0]
        if kernel not in STACKABLE or any(c[0] != kernel for c in copies):
            return
        qweight = torch.cat([c[1] for c in copies])
        qscale = torch.cat([c[2] for c in copies])
        hugepages.advise(qweight)  # the siblings' own copies were left where they were made (wrap_linears)
        biases = [m.inner.bias for m in self.members]
        given = [b for b in biases if b is not None]
        bias = None
        if given:
            bias = torch.cat([b.detach() if b is not None else given[0].new_zeros(m.out_features)
                              for b, m in zip(biases, self.members)])
        for m in self.members:  # the siblings' copies become views of the stacked one
            m.copies[key] = (kernel, qweight[m.rows], qscale[m.rows])
            if m.key == key:  # the view in place of the copy in use
                set_plain(m, qweight=qweight[m.rows], qscale=qscale[m.rows])
        self.stacked[key] = (kernel, key[1], qweight, qscale, bias)

    def output(self, x: torch.Tensor, key: tuple) -> torch.Tensor:
        """Every sibling's output for ``x``, stacked along the last dimension (computed once per input)."""
        version = -1 if x.is_inference() else x._version  # inference tensors count no in-place changes
        if x is not self.x or version != self.version:
            kernel, group, qweight, qscale, bias = self.stacked[key]
            y = quantized_mm(x.reshape(-1, x.shape[-1]), kernel, group, qweight, qscale)
            if bias is not None:
                y = y + bias
            self.x, self.version, self.y = x, version, y.reshape(*x.shape[:-1], y.shape[-1])
        return self.y

    def forget(self) -> None:
        """Drop the last input and output (at the end of a draft round)."""
        self.x, self.y = None, None


def wrap_linears(module: nn.Module, weights: str, group_size: int, fit: str = "minmax") -> list[LowPrecisionLinear]:
    """Give every linear below ``module`` a low-precision copy in this format (reusing existing wrappers); siblings
    (:data:`SIBLINGS`) that all got one share their input (:class:`SharedInput`) and a stacked copy. Each new copy
    moves onto huge pages once, where it ends up: a stacked one when stacked, the others after."""
    key = copy_key(weights, group_size, fit)
    fresh: list[LowPrecisionLinear] = []

    def make(m: nn.Module) -> LowPrecisionLinear:
        fresh.append(LowPrecisionLinear(m, weights, group_size, fit, place=False))
        return fresh[-1]

    def reuse(m: LowPrecisionLinear) -> None:
        if key not in m.copies:
            fresh.append(m)
        m.configure(weights, group_size, fit, place=False)

    found = wrap_descendants(
        module, LowPrecisionLinear,
        match=lambda m: isinstance(m, (nn.Linear, PackedLinear)),  # a packed linear stays inside the draft's copy
        make=make, on_existing=reuse,
    )
    for parent in module.modules():
        for names in SIBLINGS:
            members = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, LowPrecisionLinear) for m in members):
                continue
            if members[0].shared is None or members[0].shared.members != members:
                SharedInput(members)
            members[0].shared.stack(members[0].key)
    for m in fresh:  # what quantize would have placed (stack placed the stacked copies)
        if m.kernel == "int4-vnni" and (m.shared is None or key not in m.shared.stacked):
            hugepages.advise(m.qweight)
    return found
