"""Our fp16 product for the packed forwards on AVX2 CPUs (``csrc/fp16_panels.cpp``).

On a CPU that cannot prepack bf16 weights for oneDNN (AVX2 only, e.g. a Zen 3 EPYC), our loop's packed forwards run on
exact fp16 copies of the bf16 weights (:mod:`selfspec.kernels.packed`). fbgemm's fp16 kernel computes 6 rows at a time
and reads every weight again for each further 6, so on a 2-core Zen 3 a 1.5B forward over 8 rows cost 2.3x one over a
single row, and over 6 rows 1.45x (``scripts/verify_width.py``, docs/log.md). This kernel keeps the same fp16 copies
in panels of 16 outputs and reads each panel once for all rows of a call, in blocks of up to 6 rows whose products run
under the reading: on a 2-core Zen 3 a forward of the 1.5B over 6 rows costs 1.22-1.29 plain steps over
one (docs/kernels.md), and each further 6 rows add a pass over the weights from cache. The sums run in fp32 as fbgemm's
do, in another order: the same numbers up to rounding. A weight that fp16 does not hold exactly (a bf16 value below
fp16's subnormals) keeps its bf16 values in the same panels (:func:`pack` with ``dtype=torch.bfloat16``), which the
kernel widens by a shift: the same fp32 weights and sums as an fp16 panel of the same values, so every row stays
row-invariant.

It is compiled on first use like the int4 kernel (:func:`selfspec.kernels.vnni.compile_extension`, ~20 s on a
2-core Zen 3) and needs AVX2, FMA and F16C. :func:`available` says whether it runs here;
``SELFSPEC_FP16_KERNEL=fbgemm`` keeps fbgemm's. The kernel that ran is recorded (``packed_weights`` in a run's
decode settings, ``kernels`` in the machine fingerprint), so runs and cost models of the two never mix.
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from selfspec.kernels import hugepages, vnni

SOURCE = Path(__file__).parent / "csrc" / "fp16_panels.cpp"
FLAGS = ("fma", "avx2", "f16c")
# the builds, best first: name -> (the CPU flags it needs, the compiler's flags); the AVX-512 one computes the same
# bits (one FMA chain per output either way) with blocks of up to 12 rows in zmm registers
BUILDS = {"avx512": (("fma", "f16c", "avx512f"), ("-mfma", "-mavx2", "-mf16c", "-mavx512f")),
          "avx2": (FLAGS, ("-mfma", "-mavx2", "-mf16c"))}
REVISION = 6  # a change that moves its speed is a new revision: cost models timed on another re-measure (r3: bf16
# panels for weights fp16 does not hold, which ran on oneDNN's fp32 kernel before; r4: blocks of 6 rows, one FMA chain
# per output, so a 6-row forward passes over the weights once; r5: the AVX-512 build, two panels a pass; r6: the AVX2
# build runs calls of over 128 rows (a prefill's) 128 rows at a time; the AVX-512 build's code is r5's)
PANEL = 16  # outputs per panel
ENV = "SELFSPEC_FP16_KERNEL"  # fbgemm: never use this kernel


def available() -> bool:
    """Whether the packed fp16 products run on this kernel here (builds it on first call)."""
    return _KERNEL.load()[0] is not None


def unavailable_reason() -> str | None:
    return _KERNEL.load()[1]


def label() -> str:
    """The kernel's name in records: ``panels r<revision>``, ``panels avx512 r<revision>`` for the AVX-512 build."""
    return f"panels r{REVISION}" if _KERNEL.load()[2] != "avx512" else f"panels avx512 r{REVISION}"


def build_in_background() -> threading.Thread:
    """Start building (or loading) the kernel in a thread; join it before timing anything."""
    return _KERNEL.build_in_background("fp16-kernel-build")


@functools.cache
def _load_once():
    return vnni.load_kernel(ENV, "fbgemm", {name: needs for name, (needs, _) in BUILDS.items()}, build,
                            "packed fp16 products run on fbgemm's kernel, not ours")


def build(name: str = "avx2"):
    """Compile (or load the cached) build ``name`` of :data:`BUILDS`; its operators, ``torch.ops.selfspec_fp16``."""
    suffix = "" if name == "avx2" else f"-{name}"  # the AVX2 build keeps the folder it had
    vnni.compile_extension(SOURCE, f"fp16_panels{suffix}", ["-O3", "-fopenmp", *BUILDS[name][1]])
    return torch.ops.selfspec_fp16


_KERNEL = vnni.LazyKernel(_load_once)


def pack(weight: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The panels ``[ceil(N/16), K, 16]`` of a weight ``[N, K]`` in ``dtype``: fp16 (exact where the weight's values
    fit fp16) or bf16 (exact for a bf16 weight), on huge pages where they can be (:mod:`selfspec.kernels.hugepages`)."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"fp16 panels hold fp16 or bf16 weights, not {dtype}")
    n, k = weight.shape
    panels = -(-n // PANEL)
    padded = torch.zeros(panels * PANEL, k, dtype=dtype)
    padded[:n] = weight
    out = padded.reshape(panels, PANEL, k).transpose(1, 2).contiguous()
    hugepages.advise(out)
    return out


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The weight ``[n, K]`` (in the panels' dtype) that :func:`pack` laid out."""
    p, k, _ = panels.shape
    return panels.transpose(1, 2).reshape(p * PANEL, k)[:n]


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    """``x @ w.T + bias`` for ``x [..., K]`` (bf16 or fp32), in x's dtype; ``bias`` fp32 or None."""
    module = _KERNEL.load()[0]
    if module is None:
        raise RuntimeError(f"the fp16 panel kernel does not run here: {unavailable_reason()}")
    lead = x.shape[:-1]
    y = module.fp16_mm(x.reshape(-1, x.shape[-1]), panels, bias, n)
    return y.reshape(*lead, n)
