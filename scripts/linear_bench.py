"""How fast one linear layer reads its weights: stock ``F.linear`` against the prepacked copy, from memory and from cache.

    python scripts/linear_bench.py [--rows 1 3 6] [--dtype bfloat16] [--resident-mb 8]

Times the MLP products of Qwen2.5-Coder-1.5B (1536x8960 and 8960x1536, random
weights, ``--layers`` of each so that the weights do not fit in cache) for 1, 5
and 150 input rows (a decode step, a verify pass of k=4, a prefill), alternating
the two kernels, and reports weight bytes read per second (best of ``--reps``)
and whether the outputs are bit-identical; for scale, also the rate at which a plain
``sum`` reads the same weights. The packed kernel is timed again on 1536x1536 weights of ``--resident-mb`` in all,
which stay in the last-level cache: the rate at which it computes when memory is not what holds it back.
``compute_over_memory`` is that rate over the rate from memory: well above 1, the products over that many rows
wait on memory and further rows are nearly free; near 1, on the kernel's own work (its FMAs, or its passes over
each block of weights; the in-cache calls are short, so their fixed cost counts too). Appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from selfspec.kernels.packed import PackedLinear, pack_label
from selfspec.provenance import append_row, git_commit, machine_fingerprint

SQUARE = 1536  # the in-cache weights' side: the 1.5B's hidden size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 150])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--resident-mb", type=float, default=8.0,
                    help="MiB of 1536x1536 weights for the in-cache timing (0: none); keep it well inside the L3")
    ap.add_argument("--out", default="results/linear_bench.jsonl")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    linears = []
    for _ in range(args.layers):
        for shape in ((8960, 1536), (1536, 8960)):
            lin = torch.nn.Linear(shape[1], shape[0], bias=False).to(dtype)
            linears.append(PackedLinear(lin))
    nbytes = _weight_bytes(linears)
    square = SQUARE * SQUARE * torch.tensor([], dtype=dtype).element_size()
    resident = [PackedLinear(torch.nn.Linear(SQUARE, SQUARE, bias=False).to(dtype))
                for _ in range(max(1, round(args.resident_mb * 2**20 / square)) if args.resident_mb > 0 else 0)]
    res = {"dtype": args.dtype, "weight_mb": round(nbytes / 2**20), "kernels": pack_label(),
           "resident_mb": round(_weight_bytes(resident) / 2**20, 1), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "machine": machine_fingerprint(), "git_commit": git_commit(),
           "rows": {}}
    with torch.inference_mode():
        best_sum = float("inf")
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for lin in linears:
                lin.weight.sum()
            best_sum = min(best_sum, time.perf_counter() - t0)
        res["sum_gb_s"] = round(nbytes / best_sum / 1e9, 1)
        print(f"sum over the weights: {res['sum_gb_s']} GB/s", flush=True)
        for m in args.rows:
            xs = {lin.in_features: torch.randn(m, lin.in_features, dtype=dtype) for lin in linears}
            identical = all(torch.equal(F.linear(xs[lin.in_features], lin.weight),
                                        _packed(lin, xs[lin.in_features])) for lin in linears[:2])
            best = {"stock": float("inf"), "packed": float("inf")}
            for rep in range(args.reps):
                for name in (("stock", "packed") if rep % 2 == 0 else ("packed", "stock")):
                    t0 = time.perf_counter()
                    for lin in linears:
                        x = xs[lin.in_features]
                        F.linear(x, lin.weight) if name == "stock" else _packed(lin, x)
                    best[name] = min(best[name], time.perf_counter() - t0)
            row = {f"{k}_gb_s": round(nbytes / v / 1e9, 1) for k, v in best.items()}
            row["packed_over_stock"] = round(best["stock"] / best["packed"], 2)
            row["bit_identical"] = identical
            if resident:
                cached = _resident_seconds(resident, m, dtype, nbytes, args.reps)
                row["packed_resident_gb_s"] = round(nbytes / cached / 1e9, 1)
                row["compute_over_memory"] = round(best["packed"] / cached, 2)
            res["rows"][m] = row
            print(f"{m:4d} rows: stock {row['stock_gb_s']} GB/s, packed {row['packed_gb_s']} GB/s "
                  f"({row['packed_over_stock']}x), bit-identical: {identical}"
                  + (f"; in cache {row['packed_resident_gb_s']} GB/s ({row['compute_over_memory']}x)" if resident else ""),
                  flush=True)
    append_row(args.out, res, echo=False)


def _resident_seconds(resident: list[PackedLinear], m: int, dtype: torch.dtype, nbytes: int, reps: int) -> float:
    """The best of ``reps`` times for the packed products over cached weights to read ``nbytes`` in all."""
    x = torch.randn(m, SQUARE, dtype=dtype)
    per_pass = _weight_bytes(resident)
    passes = max(1, round(nbytes / per_pass))
    for lin in resident:  # into the cache
        _packed(lin, x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(passes):
            for lin in resident:
                _packed(lin, x)
        best = min(best, (time.perf_counter() - t0) * nbytes / (passes * per_pass))
    return best


def _weight_bytes(linears: list[PackedLinear]) -> int:
    return sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)


def _packed(lin: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    lin.active = True
    try:
        return lin(x)
    finally:
        lin.active = False


if __name__ == "__main__":
    main()
