"""What the decode attention saves: one layer's attention alone, and whole steps of a model, SDPA against it.

    python scripts/attention_bench.py [--model qwen2.5-coder-1.5b] [--contexts 300 1000] [--reps 7]

Part 1, the attention alone: for each context length and 1 or 6 query rows (the model's head counts and head
size, bf16, random values), transformers' SDPA function against :func:`selfspec.engine.attention.attention_forward`,
with a causal mask over the cached keys (none for one row, as the model passes it), and the decode attention
not row-invariant (``row_invariant=False``: matrix products, the keys reduced as they come). The decode attention by
default runs bf16 rows on the C++ row kernel where it builds (row-invariant by construction), else on padded products.
Part 2, steps of the model on its packed weights after a prefill of that many tokens: a one-row AR step, our AR
step padded to 6 rows, a 4-row verify, a 13-row tree verify (3 candidates of 4 tokens) and a one-row int4 g128
full-depth draft step (full int4 head), each with each attention, all round-robin (a warm-up repetition first),
medians; and for each step, the row-invariant decode attention's speed over the unpadded one (time of the unpadded
over time of the row-invariant, summed over the repetitions: below 1 where row-invariance costs) with a 95%
bootstrap interval over the repetitions, each repetition a pair. Prints and appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from selfspec.assets.models import load_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.attention import CHUNK, attention_forward, decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.engine.stats import Clock
from selfspec.engine.tree import DraftTree, tree_attention_mask
from selfspec.eval.records import seconds_ratio
from selfspec.kernels.packed import kernels_label, packed_weights
from selfspec.model.plan import SkipPlan
from selfspec.provenance import append_row, git_commit, machine_fingerprint


def round_robin(model, fns: dict, reps: int, clock: Clock, raw: dict | None = None) -> dict[str, float]:
    """Median milliseconds of each ``(attention, fn)``, round-robin, repetition 0 a warm-up; ``attention`` None is
    SDPA, else the decode attention with keys padded to chunks of that many (1: unpadded). ``raw``: filled with each
    one's seconds per repetition."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for rep in range(reps + 1):
        for name, (chunk, fn) in fns.items():
            with decode_attention(model, chunk is not None, chunk != 1):
                t0 = clock.now()
                fn()
                dt = clock.now() - t0
            if rep:
                times[name].append(dt)
    if raw is not None:
        raw.update(times)
    return {name: round(statistics.median(v) * 1e3, 3) for name, v in times.items()}


def invariance_ratios(times: dict[str, list[float]]) -> dict[str, list[float]]:
    """Per step: [unpadded over row-invariant summed over the repetitions, its 95% bootstrap interval] (paired by
    repetition: one step a repetition at each speed, :func:`~selfspec.eval.records.seconds_ratio`)."""
    out = {}
    for name in times:
        if not name.endswith(" decode"):
            continue
        step = name[: -len(" decode")]
        out[step] = [round(v, 4) for v in seconds_ratio(times[name], times[step + " decode unpadded"])]
    return out


def time_steps(model, draft: DraftPath, keys: int, reps: int, clock: Clock, raw: dict) -> dict[str, float]:
    """Each step after a prefill of ``keys`` tokens, with SDPA and with the decode attention (packed weights);
    ``raw`` gets the seconds of every repetition."""
    ctx = torch.arange(1000, 1000 + keys)
    cache = PositionalKVCache(model, max_len=keys + 16)
    draft.prepare(ctx)

    def drafted():
        with draft.drafting():
            forward_at(model, cache, ctx[-1:], keys, keep=1)

    tree = DraftTree(int(ctx[-1]), budget=12)  # 3 candidates of 4 tokens under the pending token: 13 rows
    for c in range(3):
        tree.add_path([100 + 10 * c + i for i in range(4)], "copy")
    nodes, depth = torch.tensor(tree.tokens), torch.tensor(tree.depth)

    def tree_verify():
        mask = tree_attention_mask(model, tree, keys, "cpu")
        forward_at(model, cache, nodes, keys, keep=len(nodes), position_ids=keys + depth, attention_mask=mask)

    fns = {}
    for chunk, att in ((None, "sdpa"), (1, "decode unpadded"), (CHUNK, "decode")):
        fns[f"AR 1 row {att}"] = (chunk, lambda: forward_at(model, cache, ctx[-1:], keys, keep=1))
        fns[f"AR 6 rows {att}"] = (chunk, lambda: forward_at(model, cache, ctx[-1:], keys, keep=1, rows=6))
        fns[f"verify 4 rows {att}"] = (chunk, lambda: forward_at(model, cache, ctx[-4:], keys, keep=4))
        fns[f"verify 6 rows {att}"] = (chunk, lambda: forward_at(model, cache, ctx[-6:], keys, keep=6))
        fns[f"tree verify 13 rows {att}"] = (chunk, tree_verify)
        fns[f"int4 draft step {att}"] = (chunk, drafted)
    with torch.inference_mode(), packed_weights(model):
        forward_at(model, cache, ctx, 0, keep=1)
        return round_robin(model, fns, reps, clock, raw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 1000])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="results/attention_bench.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    model, config = lm.model, lm.model.config.get_text_config(decoder=True)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    clock = Clock()
    n = model.config.num_hidden_layers
    draft = DraftPath(model, SkipPlan(n), DraftOptions(weights="int4", group_size=128, head_weights="int4"))
    alone, steps, ratios = {}, {}, {}
    for keys in args.contexts:
        fns = {}
        for rows in (1, 6):
            q = torch.randn(1, heads, rows, dim, dtype=torch.bfloat16)
            k, v = (torch.randn(1, kv_heads, keys, dim, dtype=torch.bfloat16) for _ in range(2))
            mask = None if rows == 1 else \
                (torch.arange(keys)[None, :] <= torch.arange(keys - rows, keys)[:, None])[None, None]
            fns[f"{rows} rows sdpa"] = (None, lambda q=q, k=k, v=v, m=mask: sdpa_attention_forward(layer, q, k, v, m))
            fns[f"{rows} rows decode unpadded"] = (
                None, lambda q=q, k=k, v=v, m=mask: attention_forward(layer, q, k, v, m, chunk=1))
            fns[f"{rows} rows decode"] = (None, lambda q=q, k=k, v=v, m=mask: attention_forward(layer, q, k, v, m))
        with torch.inference_mode():
            alone[keys] = round_robin(model, fns, 10 * args.reps, clock)
        raw: dict[str, list[float]] = {}
        steps[keys] = time_steps(model, draft, keys, args.reps, clock, raw)
        ratios[keys] = invariance_ratios(raw)
        print(args.model, keys, "attention alone (ms):", alone[keys], "steps (ms):", steps[keys], flush=True)
        print(args.model, keys, "row-invariant steps' speed over unpadded (95%):", ratios[keys], flush=True)
    res = {"model": args.model, "kernels": kernels_label(True), "heads": heads, "kv_heads": kv_heads, "head_dim": dim,
           "reps": args.reps, "attention_alone_ms": alone, "step_ms": steps,
           "row_invariant_speed_ratio": ratios,
           "machine": machine_fingerprint(), "git_commit": git_commit()}
    append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
