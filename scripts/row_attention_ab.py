"""The row attention of this checkout against its source at a git revision, built side by side, in one process.

    python scripts/row_attention_ab.py [--rev HEAD~1] [--model qwen2.5-coder-1.5b] [--contexts 400 1000]
                                       [--rows 1 7 11] [--reps 15] [--forwards]

The revision's ``csrc/row_attention.cpp`` (with the headers of its ``csrc``) is built into a library of its own, its
operator and C++ namespaces renamed, with this checkout's compiler flags for this CPU, so the two kernels load in one
process. Then, with the model's head counts and head size:

1. the kernel alone: random bf16 queries of each of ``--rows`` over a cache of each of ``--contexts`` keys (each row
   its causal share of them), the two kernels in rotating order, ``--reps`` turns of 20 calls each after a warm-up
   turn; medians, and whether the two outputs are equal to the bit, with and without a key list;
2. with ``--forwards``, whole forwards of the model on its packed weights and the decode attention after a prefill
   of each context: a step of each of ``--rows`` with the full model's attention on each kernel (the decode
   attention's ``vnni.row_attention`` switched), all in rotating order after a warm-up turn; medians over the
   revision's one-row step.

Each ``this_over_revision`` is this checkout's seconds over the revision's, summed over the turns, with a 95%
bootstrap interval over the turns, each turn a pair (``[ratio, lo, hi]``).

The fused draft steps build the attention into this checkout's library only, so draft steps are not compared.
Prints and appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time

import torch

from selfspec.engine.harness import rotated
from selfspec.eval.records import seconds_ratio
from selfspec.kernels import vnni
from selfspec.provenance import append_row, git_commit, machine_fingerprint

CSRC = "selfspec/kernels/csrc"


def renamed(text: str, tag: str) -> str:
    """A row-attention source (or header) with its operators in namespace ``selfspec_<tag>`` and its C++ functions
    in namespace ``selfspec_<tag>``, so that it loads beside this checkout's library."""
    text = re.sub(r"TORCH_LIBRARY(_FRAGMENT)?\(selfspec_vnni,", f"TORCH_LIBRARY(selfspec_{tag},", text)
    text = text.replace("TORCH_LIBRARY_IMPL(selfspec_vnni,", f"TORCH_LIBRARY_IMPL(selfspec_{tag},")
    text = text.replace("namespace selfspec {", f"namespace selfspec_{tag} {{")
    return text.replace("selfspec::attend_heads", f"selfspec_{tag}::attend_heads")


def build_revision(rev: str):
    """The revision's row attention, built (or loaded from the cache) as its own library: its operator."""
    from selfspec.assets.fetch import default_cache_dir

    sha = subprocess.run(["git", "rev-parse", rev], capture_output=True, text=True, check=True).stdout.strip()
    tag = f"rev{sha[:10]}"
    where = default_cache_dir() / "kernels" / f"row_attention-{tag}-src"
    where.mkdir(parents=True, exist_ok=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", sha, f"{CSRC}/"], capture_output=True, text=True,
                           check=True).stdout.split()
    for name in [n for n in names if n.endswith(".h")] + [f"{CSRC}/row_attention.cpp"]:
        text = renamed(subprocess.run(["git", "show", f"{sha}:{name}"], capture_output=True, text=True,
                                      check=True).stdout, tag)
        path = where / name.rsplit("/", 1)[-1]
        if not path.exists() or path.read_text() != text:  # an unchanged file keeps its time: no rebuild
            path.write_text(text)
    vnni.compile_extension(where / "row_attention.cpp", f"row_attention-{tag}", ["-O3", "-fopenmp",
                                                                                   *vnni.BUILDS[vnni.isa()][1]])
    return sha, getattr(torch.ops, f"selfspec_{tag}").row_attention


def time_kernels(kernels: dict, heads: int, kv_heads: int, dim: int, keys: int, rows: int, reps: int,
                 calls: int = 20) -> dict:
    """Part 1 for one context and width: each kernel's median over ``reps`` rotating turns of ``calls`` calls."""
    g = torch.Generator().manual_seed(keys * 100 + rows)
    q = torch.randn(heads, rows, dim, generator=g).bfloat16()
    k, v = (torch.randn(kv_heads, keys, dim, generator=g).bfloat16() for _ in range(2))
    count = torch.arange(keys - rows + 1, keys + 1).clamp(min=1)
    index = torch.stack([torch.randperm(keys, generator=g) for _ in range(rows)])
    outs = [(f(q, k, v, count, None, 0.1), f(q, k, v, count, index, 0.1)) for f in kernels.values()]
    identical = all(torch.equal(a, b) for a, b in zip(outs[0], outs[-1]))
    times = {name: [] for name in kernels}
    for rep in range(reps + 1):
        for name in rotated(list(kernels), rep):
            t0 = time.perf_counter()
            for _ in range(calls):
                kernels[name](q, k, v, count, None, 0.1)
            if rep:
                times[name].append((time.perf_counter() - t0) / calls)
    return {"us": {name: round(statistics.median(t) * 1e6, 2) for name, t in times.items()},
            "this_over_revision": [round(v, 4) for v in seconds_ratio(times["revision"], times["this"])],
            "identical": identical}


def time_forwards(model, kernels: dict, keys: int, widths: list[int], reps: int) -> dict:
    """Part 2 for one context: a forward of each width with each kernel, rotating; medians over the revision's one-row
    step."""
    from selfspec.engine.attention import decode_attention
    from selfspec.engine.cache import PositionalKVCache
    from selfspec.engine.decoding import forward_at
    from selfspec.kernels.packed import packed_weights

    g = torch.Generator().manual_seed(keys)
    ids = torch.randint(100, 20000, (keys,), generator=g)
    tokens = torch.randint(100, 20000, (max(widths),), generator=g)
    configs = [(m, name) for m in widths for name in kernels]
    times = {c: [] for c in configs}
    own = vnni.row_attention
    try:
        with torch.inference_mode(), packed_weights(model), decode_attention(model, True):
            cache = PositionalKVCache(model, max_len=keys + max(widths) + 1)
            forward_at(model, cache, ids, 0, 1)
            for rep in range(reps + 1):
                for m, name in rotated(configs, rep):
                    vnni.row_attention = kernels[name]
                    t0 = time.perf_counter()
                    forward_at(model, cache, tokens[:m], keys, m)
                    if rep:
                        times[(m, name)].append(time.perf_counter() - t0)
    finally:
        vnni.row_attention = own
    med = {c: statistics.median(t) for c, t in times.items()}
    base = med[(min(widths), "revision")]
    return {str(m): {"over_revision_step": {name: round(med[(m, name)] / base, 4) for name in kernels},
                     "this_over_revision": [round(v, 4) for v in seconds_ratio(times[(m, "revision")],
                                                                              times[(m, "this")])]}
            for m in widths}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rev", default="HEAD~1", help="the git revision whose row attention is the baseline")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--contexts", type=int, nargs="+", default=[400, 1000])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 7, 11])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--forwards", action="store_true", help="also time whole forwards of the model with each kernel")
    ap.add_argument("--out", default="results/row_attention_ab.jsonl")
    args = ap.parse_args()
    if not vnni.available():
        ap.error(f"the C++ kernels do not run here: {vnni.unavailable_reason()}")
    if min(args.rows) < 1 or args.reps < 1 or min(args.contexts) < max(args.rows):
        ap.error("--rows and --reps must be at least 1, and every context at least the widest row count")
    from selfspec.assets.models import load_model

    model = load_model(args.model).model
    cfg = model.config.get_text_config(decoder=True)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    sha, theirs = build_revision(args.rev)
    kernels = {"this": vnni.row_attention, "revision": theirs}
    res = {"model": args.model, "revision": sha, "git_commit": git_commit(), "machine": machine_fingerprint(),
           "heads": heads, "kv_heads": kv_heads, "head_dim": dim, "reps": args.reps, "kernel": {}, "forwards": {}}
    for keys in args.contexts:
        for rows in args.rows:
            r = res["kernel"][f"{keys}/{rows}"] = time_kernels(kernels, heads, kv_heads, dim, keys, rows, args.reps)
            print(f"{keys} keys, {rows} rows: {r['us']} us, this over the revision {r['this_over_revision']}, "
                  f"identical {r['identical']}", flush=True)
        if args.forwards:
            f = res["forwards"][str(keys)] = time_forwards(model, kernels, keys, args.rows, args.reps)
            print(f"{keys} keys, forwards: {f}", flush=True)
    append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
