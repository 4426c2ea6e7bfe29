"""Our bf16 product on AMX tiles for the packed forwards on a CPU with AMX, or on AVX-512's bf16 dot product on a CPU
with AVX-512 BF16 and no AMX (``csrc/amx_bf16.cpp``).

On a Xeon with AMX the full model's one-row steps and verifies ran on our fp16 panels (:mod:`selfspec.kernels.fp16`),
whose fp32 FMAs made each row of a verify cost more: a 6-row forward of the 1.5B took 1.12 one-row steps there. This
kernel keeps each bf16 weight, exactly, in VNNI panels of 16 outputs (pairs of inputs side by side, as AMX's tile
product reads them) and reads each panel once per call for up to 16 rows, 32 inputs a tile product. bf16 products
are exact in fp32, so its sums are those of the stock bf16 kernel up to their order; every row takes the same blocks
in the same order whatever the call's row count, so a row computes the same bits in a one-row step as in a verify
(row-invariant, docs/numerics.md).

On a Zen 4 (AVX-512 BF16, no tiles) the ``dot`` build runs the same panels on ``vdpbf16ps``: a pair of inputs for 16
outputs an instruction, one accumulator a row and 16 outputs, summed over the pairs in order, so it is row-invariant
too. There a one-row forward of the 1.5B took 0.73 of oneDNN's and 0.96 of the fp16 panels', a 6-row one 0.90 and
0.68 of theirs (docs/kernels.md).

It is compiled on first use like the int4 kernel (:func:`selfspec.kernels.vnni.compile_extension`) and needs AMX-BF16
and a Linux that grants the process AMX's tile state (asked for once, ``arch_prctl``), or for the ``dot`` build
AVX-512 BF16. :func:`available` says whether it runs here; ``SELFSPEC_AMX_KERNEL=off`` keeps the fp16 panels (on AMX)
or oneDNN. The kernel that ran is recorded (``packed_weights`` in
a run's decode settings, ``kernels`` in the machine fingerprint), so runs and cost models of the two never mix.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from selfspec.kernels import hugepages, vnni

SOURCE = Path(__file__).parent / "csrc" / "amx_bf16.cpp"
NEEDS = ("amx_tile", "amx_bf16", "avx512f")  # the CPU flags the tile build needs
# the builds, best first: name -> (the CPU flags it needs, the compiler's flags); "dot" runs the same panels on AVX-512's
# bf16 dot product where a CPU has no tiles (a Zen 4), with the same row-invariant sums per row
BUILDS = {"amx": (NEEDS, ("-mavx512f", "-mamx-tile", "-mamx-bf16")),
          "dot": (("avx512f", "avx512_bf16"), ("-mavx512f", "-mavx512bf16"))}
BUILD_NEEDS = {name: needs for name, (needs, _) in BUILDS.items()}  # name -> the CPU flags it needs
REVISION = 1  # a change that moves its speed is a new revision: cost models timed on another re-measure
PANEL = 16  # outputs per panel
KB = 32  # inputs per tile product: a weight's inputs are padded to a multiple
ENV = "SELFSPEC_AMX_KERNEL"  # off: never use this kernel


def cpu_can_build() -> bool:
    """Whether this CPU's flags name those of one of :data:`BUILDS` (AMX tiles, or AVX-512 BF16)."""
    return vnni.best_build(BUILD_NEEDS) is not None


def cpu_has_amx() -> bool:
    """Whether this CPU's flags name AMX with bf16 tile products (whether the kernel builds and the OS grants its
    tiles is :func:`available`)."""
    return all(flag in vnni.cpu_flags() for flag in NEEDS)


def available() -> bool:
    """Whether the packed products run on this kernel here (builds it on first call)."""
    return _KERNEL.load()[0] is not None


def unavailable_reason() -> str | None:
    return _KERNEL.load()[1]


def label() -> str:
    """The kernel's name in records: ``amx r<revision>`` on tiles, ``bf16 dot r<revision>`` for the dot-product
    build."""
    return f"bf16 dot r{REVISION}" if _KERNEL.load()[2] == "dot" else f"amx r{REVISION}"


def build_in_background() -> threading.Thread:
    """Start building (or loading) the kernel in a thread; join it before timing anything."""
    return _KERNEL.build_in_background("amx-kernel-build")


@functools.cache
def _load_once():
    module, reason, name = vnni.load_kernel(ENV, "off", BUILD_NEEDS, build,
                                            "packed products run on our fp16 panels or oneDNN, not on bf16 panels")
    if module is not None and not module.permitted():
        return None, "Linux did not grant this process AMX's tile state (arch_prctl)", None
    return module, reason, name


def build(name: str = "amx"):
    """Compile (or load the cached) build ``name`` of :data:`BUILDS`; its operators, ``torch.ops.selfspec_amx``."""
    suffix = "" if name == "amx" else f"-{name}"  # the tile build keeps the folder it had
    vnni.compile_extension(SOURCE, f"amx_bf16{suffix}", ["-O3", "-fopenmp", *BUILDS[name][1]])
    return torch.ops.selfspec_amx


_KERNEL = vnni.LazyKernel(_load_once)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The VNNI panels ``[ceil(N/16), Kp/2, 16, 2]`` (bf16, ``Kp`` = K rounded up to 32) of a bf16 weight ``[N, K]``,
    zeros past N and K, on huge pages where they can be (:mod:`selfspec.kernels.hugepages`)."""
    if weight.dtype != torch.bfloat16:
        raise ValueError(f"AMX panels hold bf16 weights, not {weight.dtype}")
    n, k = weight.shape
    panels, kp = -(-n // PANEL), -(-k // KB) * KB
    padded = torch.zeros(panels * PANEL, kp, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    out = padded.reshape(panels, PANEL, kp // 2, 2).permute(0, 2, 1, 3).contiguous()
    hugepages.advise(out)
    return out


def unpack(panels: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weight ``[n, k]`` that :func:`pack` laid out (exact)."""
    p, half, _, _ = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(p * PANEL, 2 * half)[:n, :k]


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x [..., K]`` in x's dtype; ``bias`` fp32 or None. Inputs other than bf16 are rounded
    to bf16 first (a bf16 model's activations are bf16 already)."""
    module = _KERNEL.load()[0]
    if module is None:
        raise RuntimeError(f"the AMX kernel does not run here: {unavailable_reason()}")
    lead = x.shape[:-1]
    y = module.amx_mm(x.reshape(-1, x.shape[-1]).to(torch.bfloat16), panels, bias, n)
    return y.reshape(*lead, n).to(x.dtype)
