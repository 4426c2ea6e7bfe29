"""int4 draft products on AVX-512 VNNI or AVX2: int4 weights times int8 activations (``csrc/int4_vnni.cpp``).

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) multiplies bf16 activations by int4 weights in
floating point; for one row it reads about 38 G weights/s on a 2-core Zen 4, where the bandwidth would carry ~60 G
(int4 is 0.5 byte a weight). llama.cpp's way is faster: round the activations to int8 (one scale per block of
inputs, :data:`ACT_BLOCK`) and sum the products of bytes in integers (``vpdpbusd``, 64 multiply-adds an
instruction). This kernel does that for the draft's int4 copies. The weights are the same int4 values as torch's
kernel's (the same groups, scales and zero points, in another layout); only the activations are rounded, to 8 bits
with one scale per 128 inputs, which adds 0.77% relative error (0.65% with blocks of 64) to a product whose int4
weights are off by several percent already (medians over the 1.5B's linears on their own inputs, against float64
products of the same int4 weights; a bf16 output alone carries 0.17%: ``scripts/draft_kernels.py``, which also
measures the agreement with the full model, docs/kernels.md).

On a CPU without AVX-512 VNNI but with AVX2 and FMA (a Zen 3, say) the same kernel is built for 256-bit vectors,
with ``vpmaddubsw`` + ``vpmaddwd`` in place of ``vpdpbusd``; on both builds groups of 128 and 256 take one integer
sum per 64 packed bytes (one conversion and one multiply-add); on a 2-core Zen 3 it reads ~41 G int4 weights/s
at one row at g128 (docs/kernels.md).
:func:`isa` says which build runs; the name ``int4-vnni`` stays the kernel's (its layout and its method).

It is compiled on first use with torch's ``cpp_extension`` (g++ and ninja; ~30 s on 2 cores, once per machine and
torch version) into the selfspec cache (``$SELFSPEC_CACHE/kernels``). The search starts the build in a thread
(:func:`build_in_background`) while it fetches and loads the model.
:func:`available` says whether it runs here: a Linux x86 CPU with AVX-512 F/BW/VL/VNNI, or with AVX2 and FMA, and a
build that succeeded. Elsewhere, or with ``SELFSPEC_INT4_KERNEL=aten``, int4 drafts run torch's kernel (a failed
build says so on stderr, once); runs record which (``int4_kernel`` in the machine fingerprint, ``draft_kernel`` in a
method's info).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import sysconfig
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from selfspec.errors import SelfSpecError
from selfspec.kernels import hugepages
from selfspec.locks import check_writable, waiting

SOURCE = Path(__file__).parent / "csrc" / "int4_vnni.cpp"
ATTENTION_SOURCE = SOURCE.with_name("row_attention.cpp")  # the full model's decode attention, in the same library
FUSED_SOURCE = SOURCE.with_name("draft_fused.cpp")  # the fused draft calls (selfspec/draft/fused.py), the same too
# the builds, best first: name -> (the CPU flags it needs, the compiler's flags)
BUILDS = {"avx512-vnni": (("fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                          ("-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")),
          "avx2": (("fma", "avx2"), ("-mfma", "-mavx2"))}
# each build's revision: a change that moves its speed counts as a new kernel in the machine fingerprint, so that
# studies re-measure their cost models (avx2 r2: one load per 64 packed bytes and a prefetch; r3: the draft
# attention's dot products in four independent sums; avx512-vnni r2: avx2 r2's one load per 64 packed bytes and
# prefetch; avx512-vnni r3, avx2 r4: the full model's decode attention on this library's row kernel, which moves
# every full-model step's cost; avx512-vnni r4, avx2 r5: the activations rounded to int8 and the MLP's SiLU on
# vectors; avx2 r6: groups of 32 take their zero points' term as one dot product a row; avx2 r7: one activation
# scale per 128 inputs, and groups of 128 and 256 take one integer sum per 128 inputs; avx512-vnni r5: a second
# prefetch, into L2, 16 KiB ahead; avx512-vnni r6, avx2 r8: the row attention reads each value once for a head group
# and adds a block of keys' score lanes together, the same bits; avx512-vnni r7: avx2 r7's one activation scale per
# 128 inputs and one integer sum per 128 inputs for groups of 128 and 256, docs/log.md)
REVISIONS = {"avx512-vnni": 7, "avx2": 8}
# inputs per activation scale (the activations' int8 rounding): 128, so that the integer sums of 64 packed bytes meet
# before one conversion and one multiply-add (kernels.md)
ACT_BLOCK = 128
BLOCK = 128  # inputs per 64 packed bytes
GROUPS = (32, 64, 128, 256)  # the kernel's int4 group sizes
ENV = "SELFSPEC_INT4_KERNEL"  # aten: never use this kernel


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux), else none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa() -> str | None:
    """Which build of the kernel runs here (a key of :data:`BUILDS`), None where none does."""
    return _KERNEL.load()[2]


def unavailable_reason() -> str | None:
    """Why this kernel does not run here (None where it does). Builds it on first call."""
    return _KERNEL.load()[1]


def available() -> bool:
    """Whether int4 drafts run on this kernel here."""
    return _KERNEL.load()[0] is not None


def fits(in_features: int, group_size: int) -> bool:
    """Whether the kernel takes a weight of this many inputs in groups of this size."""
    return group_size in GROUPS and in_features % BLOCK == 0 and in_features % group_size == 0


class LazyKernel:
    """A kernel loaded once per process: one build at a time, a caller that comes during a background build waits
    for its result."""

    def __init__(self, load_once: Callable[[], tuple]) -> None:
        self._load_once = load_once
        self._lock = threading.Lock()

    def load(self):
        with self._lock:
            return self._load_once()

    def reset(self) -> None:
        """Forget what was loaded: the next :meth:`load` chooses and builds again (after the environment or the CPU
        flags it reads changed)."""
        with self._lock:
            self._load_once.cache_clear()

    def build_in_background(self, name: str) -> threading.Thread:
        thread = threading.Thread(target=self.load, name=name, daemon=True)
        thread.start()
        return thread


def best_build(builds: dict[str, tuple[str, ...]]) -> str | None:
    """The first of ``builds`` (name -> CPU flags, best first) whose flags this CPU has, or None."""
    flags = cpu_flags()
    return next((name for name, needs in builds.items() if all(f in flags for f in needs)), None)


def load_kernel(env: str, off: str, builds: dict[str, tuple[str, ...]], build: Callable[[str], object],
                fallback: str) -> tuple:
    """``(module, None, build name)`` or ``(None, why not, None)`` for a kernel compiled on first use: off where the
    environment variable ``env`` says ``off``, off an x86-64 CPU, or on one without the CPU flags of any of ``builds``
    (name -> flags, best first; the last is the least the kernel needs); else ``build(name)`` of the best it runs. A
    failed build falls back and says so on stderr, after ``fallback``."""
    if os.environ.get(env, "").lower() == off:
        return None, f"{env}={off}", None
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not an x86-64 CPU ({platform.machine()})", None
    name = best_build(builds)
    if name is None:
        missing = [f for f in list(builds.values())[-1] if f not in cpu_flags()]
        return None, f"the CPU lacks {', '.join(missing)}", None
    try:
        module = build(name)
    except Exception as e:  # noqa: BLE001 - a compiler, ninja or header problem: fall back, say why
        reason = f"its build failed ({type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''})"
        print(f"selfspec: {fallback}: {reason}", file=sys.stderr)
        return None, reason, None
    return module, None, name


def build_in_background() -> threading.Thread:
    """Start building (or loading) the kernel in a thread and return it: the compiler runs while the caller fetches
    and loads a model. Join it before timing anything, so that no compile runs beside a measurement."""
    return _KERNEL.build_in_background("int4-kernel-build")


@functools.cache
def _load_once():
    """(the kernel's operator namespace ``torch.ops.selfspec_vnni``, None, the build's name) or (None, why not, None);
    once per process (through :data:`_KERNEL`)."""
    return load_kernel(ENV, "aten", {name: needs for name, (needs, _) in BUILDS.items()}, lambda name: build(name),
                       "int4 drafts run torch's int4 kernel, not the VNNI kernel")


_KERNEL = LazyKernel(_load_once)


def build(name: str):
    """Compile (or load the cached) build ``name`` of :data:`BUILDS`; its operators, ``torch.ops.selfspec_vnni``."""
    suffix = "" if name == "avx512-vnni" else f"-{name}"  # the AVX-512 build keeps the folder it had
    compile_extension(SOURCE, f"int4_vnni{suffix}", ["-O3", "-fopenmp", *BUILDS[name][1]],
                      also=(ATTENTION_SOURCE, FUSED_SOURCE))
    return torch.ops.selfspec_vnni


def compile_extension(source: Path, stem: str, flags: list[str], also: tuple[Path, ...] = ()) -> None:
    """Compile (or load the cached build of) the C++ operator library ``source`` (and the sources ``also``, linked
    into it) with torch's ``cpp_extension``, into ``$SELFSPEC_CACHE/kernels/<stem>-torch<version>-<checkout>``; it
    registers its own ``torch.ops`` namespace."""
    from torch.utils.cpp_extension import load

    from selfspec.assets.fetch import default_cache_dir

    # torch's build runs `ninja` from PATH: a virtual environment's own (pip's ninja) counts when it is not activated
    scripts = sysconfig.get_path("scripts")
    if scripts and scripts not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([os.environ.get("PATH", ""), scripts]).strip(os.pathsep)
    # one build folder per checkout (the build file names the source's path: checkouts sharing a folder would
    # rebuild each other's) and torch version; torch rebuilds in place when the source changes
    where = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:12]
    build = default_cache_dir() / "kernels" / f"{stem}-torch{torch.__version__.split('+')[0]}-{where}"
    library = build / f"selfspec_{stem.replace('-', '_')}.so"
    try:
        check_writable(build, f"the {stem} kernel's build folder (set SELFSPEC_CACHE to a folder that can be written)")
    except SelfSpecError:
        # a cache that cannot be written (a read-only home, a shared copy): its build runs if it is current
        inputs = (source, *also, *source.parent.glob("*.h"))
        if library.is_file() and all(library.stat().st_mtime >= s.stat().st_mtime for s in inputs):
            torch.ops.load_library(str(library))
            return
        raise
    # torch's build guards its folder with a `lock` file that a process stopped mid-build (an error elsewhere while
    # the build ran in a background thread, a kill) leaves behind, and every later build then waits on it forever.
    # Ours is an flock, which the OS drops with its holder: while it is held no other build of ours runs here, so a
    # `lock` file found then is stale.
    with waiting(build / "lock", f"the build of the {stem} kernel in {build}"):
        stale = build / "lock"
        if stale.exists():
            print(f"selfspec: removed a stale build lock at {stale} (a build stopped before it finished)",
                  file=sys.stderr, flush=True)
            stale.unlink(missing_ok=True)
        load(library.stem, [str(s) for s in (source, *also)], extra_cflags=flags, extra_ldflags=["-fopenmp"],
             build_directory=str(build), verbose=False, is_python_module=False)


def pack(q: torch.Tensor, scale_zero: torch.Tensor, place: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout of int4 values ``q`` [N, K] (0..15) and their groups' (scale, zero) [N, K/G, 2]:
    64 bytes per 128 inputs, byte j holding inputs j (low half) and j + 64 (high half); the scales in bf16. With
    ``place``, the packed values go on huge pages where they can (:mod:`selfspec.kernels.hugepages`); without, the
    caller places what it keeps (a copy that will be stacked with its siblings' is not worth moving)."""
    n, k = q.shape
    if k % BLOCK:
        raise SelfSpecError(f"the VNNI int4 kernel needs in_features divisible by {BLOCK}, got {k}")
    halves = q.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    packed = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    if place:
        hugepages.advise(packed)
    return packed, scale_zero.to(torch.bfloat16).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The int4 values [N, K] of :func:`pack`'s layout (for tests and checks)."""
    n, half = packed.shape
    blocks = packed.reshape(n, half // (BLOCK // 2), BLOCK // 2)
    return torch.stack([blocks & 15, blocks >> 4], dim=2).reshape(n, 2 * half)


def dequantize(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """The weights [N, K] the kernel multiplies by, ``(q - 8) * scale + zero`` per group, in float64 (for tests and
    checks)."""
    scale, zero = (scale_zero[..., i].double().repeat_interleave(group_size, dim=1) for i in (0, 1))
    return (unpack(packed).double() - 8) * scale + zero


def round_activations(x2: torch.Tensor, block: int) -> torch.Tensor:
    """``x2`` [M, K] as the kernel rounds it, in float64: int8 with one scale per ``block`` inputs (the kernel's
    :data:`ACT_BLOCK`), scale = the block's largest magnitude / 127 (for tests and checks)."""
    xb = x2.double().reshape(x2.shape[0], -1, block)
    s = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(s > 0, s, 1)).clamp(-127, 127) * s).reshape(x2.shape)


def mm(x2: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """``x2 @ w.T`` for bf16 ``x2`` [M, K] and the int4 weight :func:`pack` laid out; bf16 [M, N]."""
    return _module().int4_mm(x2.contiguous(), packed, scale_zero, group_size)


def row_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: torch.Tensor,
                  index: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The row-invariant decode attention of ``csrc/row_attention.cpp`` (bf16 ``q`` [H, R, D], ``k``/``v``
    [KVH, L, D] with contiguous rows of keys, ``count`` int64 [R], ``index`` int64 [R, W] or None) as [R, H, D]."""
    return _module().row_attention(q, k, v, count, index, scale)


def _module():
    """The library's operators (``torch.ops.selfspec_vnni``); an error that says why where it does not run here."""
    module, reason, _ = _KERNEL.load()
    if module is None:
        raise SelfSpecError(f"the VNNI int4 kernel does not run here: {reason}")
    return module
