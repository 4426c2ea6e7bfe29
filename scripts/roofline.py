"""How near the decode's matrix products run to this CPU's limits: the memory's reading speed and its fp32 FMA rate.

    python scripts/roofline.py [--layers 28] [--rows 1 6 12 64] [--reps 5] [--out results/roofline.jsonl]

Limits, measured in the same process: **memory**, a plain fp32 ``sum`` over as many bytes as the weights (GB/s);
**compute**, the FMA units' peak, 12 independent chains of the widest fp32 FMA the CPU has on every thread (a probe
compiled with ``-march=native`` by the system's C compiler; where none runs, torch's fp32 product of ``--gemm`` x
``--gemm`` operands in cache stands in, and it is recorded either way). The sum, the probe and the product are timed
in the products' rotation, since a shared VM's speed drifts within minutes; a product above 1.00 of the sum's rate
reads faster than ``sum`` does. The products are the MLP shapes of Qwen2.5-Coder-1.5B (8960x1536 and 1536x8960,
random weights, ``--layers`` of each, so that they stream from memory):

- the full model's packed products (the kernel ``pack_label`` names: our fp16 panels on AVX2, oneDNN's bf16 on
  AVX-512) at each of ``--rows`` (a plain step, a verify, a prefill's block);
- the int4 draft kernel (``vnni``) at one row, g128 (a draft step's products), where it runs here; its products are
  integer ones, so only its reading is set against a limit. The same calls on one weight of each shape, which stays
  in the last-level cache, tell whether the reading holds it back (``from_memory_over_in_cache`` well below 1) or its
  own work (near 1).

For each product: the weights' bytes read a second over the memory's (``of_memory``) and its FLOP a second over the
compute limit (``of_compute``); the larger is how near it runs to what bounds it (``of_limit``). A product at 0.85 of
its limit can gain at most ~1/0.85 from any kernel. Best of ``--reps``, kernels in rotating order; one JSON line to
``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from selfspec.engine.harness import rotated
from selfspec.kernels import vnni
from selfspec.kernels.packed import PackedLinear, pack_label
from selfspec.provenance import append_row, git_commit, machine_fingerprint

SHAPES = ((8960, 1536), (1536, 8960))  # (out, in): the 1.5B's MLP products
GROUP = 128
# the FMA units' peak: 12 independent chains of the widest fp32 FMA this CPU has (-march=native), on every thread
PEAK = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#if defined(__AVX512F__)
typedef __m512 V;
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define LANES 16
#else
typedef __m256 V;
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#define LANES 8
#endif
double fma_gflops(int64_t iters, int threads) {
  double t0 = omp_get_wtime(), sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    V a[12];
    for (int i = 0; i < 12; ++i) a[i] = SET1(1e-3f * i);
    const V b = SET1(0.999999f), c = SET1(1e-7f);
    for (int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], b, c);
    for (int i = 0; i < 12; ++i) sink += ((float*)&a[i])[0];
  }
  double t = omp_get_wtime() - t0;
  return sink == 12345.678 ? 0 : 2.0 * LANES * 12 * iters * threads / t / 1e9;
}
"""


def fma_probe():
    """The FMA peak probe's ``fma_gflops(iters, threads)`` (C, built with the system's compiler in a temporary
    folder, under a second), or None where it does not build or run here."""
    try:
        with tempfile.TemporaryDirectory(prefix="selfspec-fma-") as tmp:  # the loaded library outlives its file
            folder = Path(tmp)
            (folder / "peak.c").write_text(PEAK)
            subprocess.run([os.environ.get("CC", "cc"), "-O2", "-march=native", "-fopenmp", "-shared", "-fPIC",
                            str(folder / "peak.c"), "-o", str(folder / "peak.so")], check=True, capture_output=True)
            lib = ctypes.CDLL(str(folder / "peak.so"))
        lib.fma_gflops.restype, lib.fma_gflops.argtypes = ctypes.c_double, [ctypes.c_int64, ctypes.c_int]
        return lib.fma_gflops
    except (OSError, subprocess.CalledProcessError) as e:  # no compiler: the report keeps the other limits
        print(f"the FMA peak probe did not build ({type(e).__name__}); torch's fp32 product stands in", flush=True)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 12, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gemm", type=int, default=512, help="side of the in-cache fp32 product (the compute limit)")
    ap.add_argument("--out", default="results/roofline.jsonl")
    args = ap.parse_args()
    if args.reps < 1 or args.layers < 1 or min(args.rows) < 1:
        ap.error("--reps, --layers and --rows must be at least 1")
    torch.manual_seed(0)
    linears = [PackedLinear(torch.nn.Linear(k, n, bias=False).to(torch.bfloat16))
               for _ in range(args.layers) for n, k in SHAPES]
    for lin in linears:
        lin.active = True
    int4 = [vnni.pack(torch.randint(0, 16, (lin.out_features, lin.in_features), dtype=torch.uint8),
                      torch.randn(lin.out_features, lin.in_features // GROUP, 2) * 0.01)
            for lin in linears] if vnni.available() else []
    res = {"layers": args.layers, "weights": sum(lin.in_features * lin.out_features for lin in linears),
           "kernels": pack_label(), "int4_kernel": vnni.isa(), "threads": torch.get_num_threads(),
           "machine": machine_fingerprint(), "git_commit": git_commit()}
    with torch.inference_mode():
        res["limits"], res["products"] = measure(linears, int4, args.rows, args.reps, args.gemm, res["weights"])
    append_row(args.out, res, echo=False)


def measure(linears: list[PackedLinear], int4: list, rows: list[int], reps: int, gemm: int,
            weights: int) -> tuple[dict, dict]:
    """The limits and each product's rates, all timed in one rotation (best of ``reps``, after a warm-up)."""
    dense_bytes = sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)
    big = torch.empty(dense_bytes // 4).uniform_()  # fp32: the sum reads it at the memory's speed, not converting
    a, b = torch.randn(gemm, gemm), torch.randn(gemm, gemm)
    calls = max(1, round(1e10 / (2 * gemm**3)))  # ~10 GFLOP a repetition
    xs = {m: {k: torch.randn(m, k, dtype=torch.bfloat16) for _, k in SHAPES} for m in {1, *rows}}
    runs = {"memory": big.sum, "compute": lambda: [torch.mm(a, b) for _ in range(calls)]}
    probe, peaks = fma_probe(), []
    if probe is not None:
        runs["peak"] = lambda: peaks.append(probe(100_000_000, torch.get_num_threads()))  # ~0.1 s
    runs |= {f"packed x{m}": (lambda m=m: [lin(xs[m][lin.in_features]) for lin in linears]) for m in rows}
    if int4:
        x1 = xs[1]
        runs["int4 x1"] = lambda: [vnni.mm(x1[lin.in_features], p, sz, GROUP) for lin, (p, sz) in zip(linears, int4)]
        # the same calls on one weight of each shape (~14 MB), which stays in the last-level cache
        runs["int4 cached"] = lambda: [vnni.mm(x1[lin.in_features], *int4[i % 2], GROUP)
                                       for i, lin in enumerate(linears)]
    best = {name: float("inf") for name in runs}
    names = list(runs)
    for rep in range(reps + 1):  # rotating order, the limits among the products; repetition 0 warms up
        for name in rotated(names, rep):
            t0 = time.perf_counter()
            runs[name]()
            if rep:
                best[name] = min(best[name], time.perf_counter() - t0)
    memory = big.numel() * 4 / best.pop("memory") / 1e9
    compute = 2 * gemm**3 * calls / best.pop("compute") / 1e9
    best.pop("peak", None)
    peak = max(peaks[1:]) if probe is not None else None  # the warm-up's left out
    limits = {"memory_gb_s": round(memory, 1), "gemm_gflop_s": round(compute, 1),
              "fma_peak_gflop_s": None if peak is None else round(peak, 1)}
    print(f"limits on {torch.get_num_threads()} threads: memory {memory:.1f} GB/s (an fp32 sum over as many bytes as "
          "the bf16 weights); compute " + ("(no FMA probe) " if peak is None else f"{peak:.1f} GFLOP/s (the FMA units' "
          "peak), ") + f"torch's fp32 {gemm}x{gemm} products in cache {compute:.1f} GFLOP/s", flush=True)
    packed_bytes = sum(lin.extra_bytes or lin.weight.numel() * lin.weight.element_size() for lin in linears)
    int4_bytes = sum(p.numel() + 2 * sz.numel() for p, sz in int4)
    cached = best.pop("int4 cached", None)
    products = {}
    for name, t in best.items():
        is_int4 = name.startswith("int4")
        m, nbytes = (1, int4_bytes) if is_int4 else (int(name.split("x")[1]), packed_bytes)
        gb_s, gflop_s = nbytes / t / 1e9, 2 * weights * m / t / 1e9
        row = {"rows": m, "ms": round(t * 1e3, 3), "mb": round(nbytes / 1e6, 3), "gb_s": round(gb_s, 1),
               "gflop_s": round(gflop_s, 1), "of_memory": round(gb_s / memory, 2)}
        if not is_int4:
            row["of_compute"] = round(gflop_s / (peak or compute), 2)
        row["of_limit"] = max(row["of_memory"], row.get("of_compute", 0))
        if is_int4 and cached is not None:  # near 1: the kernel's own work holds it back, not the reading
            row["in_cache_gb_s"] = round(nbytes / cached / 1e9, 1)
            row["from_memory_over_in_cache"] = round(cached / t, 2)
        products[name] = row
        print(f"{name:12} {t * 1e3:8.1f} ms  {gb_s:6.1f} GB/s ({row['of_memory']:.2f} of memory)  {gflop_s:7.1f} GFLOP/s"
              + (f" ({row['of_compute']:.2f} of compute)" if "of_compute" in row else "")
              + f"  -> {row['of_limit']:.2f} of its limit"
              + (f"; in cache {row['in_cache_gb_s']} GB/s" if "in_cache_gb_s" in row else ""), flush=True)
    return limits, products


if __name__ == "__main__":
    main()
