"""Where one draft step's time goes: the operators of a full-depth int4 draft step, by torch.profiler.

    python scripts/profile_draft_step.py [--model qwen2.5-coder-1.5b] [--keys 300] [--steps 10] [--k 3] [--loop 5]

One-row draft steps through the draft's low-precision copies (int4 g128 kept weights, full int4 head, no sublayer
skipped: the searched 1.5B draft's kind) after a prefill of ``--keys`` tokens, on the packed weights and the decode
attention, as decoding runs them: ``--k`` steps (positions keys .. keys+k-1) inside one ``drafting()`` block, as one
round's draft. Prints the median wall time of a step (a round's over k, unprofiled), then the profiler's operator
self-time table over ``--steps`` rounds, and appends one JSON line to --out: the step's wall time, the operators'
summed self time per step, the int4 products' share, the fused sublayers' (selfspec.draft.fused: one operator per
kept sublayer, its products included, and with the fused draft step its norm and residual add too;
``SELFSPEC_FUSED_DRAFT=0`` drafts through the modules instead), and the rest
(what the step spends outside operators: Python, module calls, the profiler's own cost).

``--loop R`` also times the same draft inside the decoding loop, in the same process: R repetitions, each an
isolated round as above and a self-speculative run of 64 tokens from the same context (a chain of k, no copies, no
gate or fallback), in rotating order; a run's draft time over its drafted tokens is a draft step in the loop, with
the loop's own work around it (the drafting switch, argmax, token bookkeeping). The record adds both medians and
their difference.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from selfspec.assets.models import load_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import DecodeConfig, forward_at
from selfspec.engine.harness import rotated
from selfspec.engine.speculate import self_speculative
from selfspec.engine.stats import Clock
from selfspec.kernels.packed import packed_weights
from selfspec.model.plan import SkipPlan
from selfspec.provenance import append_row, git_commit, machine_fingerprint

PRODUCTS = ("selfspec_vnni::int4_mm", "_weight_int4pack_mm_for_cpu")
# whole sublayers, products included (the _block forms, a fused draft step's, also hold the norm and residual add)
FUSED = ("selfspec_vnni::draft_attention", "selfspec_vnni::draft_mlp", "selfspec_vnni::draft_attention_block",
         "selfspec_vnni::draft_mlp_block")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--keys", type=int, default=300)
    ap.add_argument("--steps", type=int, default=10, help="draft rounds timed (and profiled)")
    ap.add_argument("--k", type=int, default=3, help="draft steps a round (one drafting() block)")
    ap.add_argument("--loop", type=int, default=0, help="repetitions of the in-loop comparison (0: none)")
    ap.add_argument("--out", default="results/draft_step_profile.jsonl")
    args = ap.parse_args()
    model = load_model(args.model).model
    draft = DraftPath(model, SkipPlan(model.config.num_hidden_layers),
                      DraftOptions(weights="int4", group_size=128, head_weights="int4"))
    ctx = torch.arange(1000, 1000 + args.keys)
    cache = PositionalKVCache(model, max_len=args.keys + args.k + 16)
    draft.prepare(ctx)
    clock = Clock()

    def draft_round() -> None:  # k steps
        with draft.drafting():
            for j in range(args.k):
                forward_at(model, cache, ctx[-1:], args.keys + j, keep=1)

    with torch.inference_mode(), packed_weights(model), decode_attention(model, True):
        forward_at(model, cache, ctx, 0, keep=1)
        for _ in range(3):
            draft_round()
        wall = []
        for _ in range(args.steps):
            t0 = clock.now()
            draft_round()
            wall.append((clock.now() - t0) / args.k)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                draft_round()
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=20))
    per_step = {e.key: e.self_cpu_time_total / 1e3 / (args.steps * args.k) for e in events}  # ms
    ops = sum(per_step.values())
    products = sum(v for k, v in per_step.items() if any(p in k for p in PRODUCTS))
    sublayers = sum(v for k, v in per_step.items() if k in FUSED)
    step_ms = statistics.median(wall) * 1e3
    top = dict(sorted(per_step.items(), key=lambda kv: -kv[1])[:12])
    print(f"step {step_ms:.1f} ms (median, unprofiled); operators {ops:.1f} ms a step (profiled), of which int4 "
          f"products {products:.1f} ms and fused sublayers {sublayers:.1f} ms ({len(draft.fused)} of them); "
          f"kernels: {draft.kernels}")
    row = {"model": args.model, "keys": args.keys, "steps": args.steps, "k": args.k, "kernels": draft.kernels,
           "step_ms": round(step_ms, 2), "operators_ms": round(ops, 2), "int4_products_ms": round(products, 2),
           "fused_sublayers": len(draft.fused), "fused_sublayers_ms": round(sublayers, 2),
           "top_operators_ms": {k: round(v, 3) for k, v in top.items()},
           "machine": machine_fingerprint(), "git_commit": git_commit()}
    if args.loop:
        row["loop"] = in_loop(model, draft, ctx, args.k, args.loop, draft_round, clock)
    append_row(args.out, row, echo=False)


def in_loop(model, draft: DraftPath, ctx: torch.Tensor, k: int, reps: int, draft_round, clock: Clock) -> dict:
    """Medians over ``reps`` rotating repetitions: an isolated draft step (``draft_round`` over k) against a draft step
    inside :func:`~selfspec.engine.speculate.self_speculative` (draft time over drafted tokens) on the same draft."""
    cfg = DecodeConfig(max_new_tokens=64, k=k, fallback=False, gate=False)
    prompt = ctx.tolist()

    def isolated() -> float:
        with torch.inference_mode(), packed_weights(model), decode_attention(model, True):
            t0 = clock.now()
            draft_round()
            return (clock.now() - t0) / k

    def looped() -> float:
        st = self_speculative(model, prompt, draft.plan, cfg, draft=draft).stats
        return st.draft_time / st.drafted

    looped()  # warm-up
    times: dict[str, list[float]] = {"isolated": [], "loop": []}
    for rep in range(reps):
        for name in rotated(["isolated", "loop"], rep):
            times[name].append(isolated() if name == "isolated" else looped())
    iso, loop = (statistics.median(times[n]) * 1e3 for n in ("isolated", "loop"))
    print(f"in the loop: a draft step {loop:.1f} ms against {iso:.1f} ms isolated: the loop adds {loop - iso:+.1f} ms "
          f"(medians of {reps})")
    return {"isolated_step_ms": round(iso, 2), "loop_step_ms": round(loop, 2), "loop_adds_ms": round(loop - iso, 2),
            "reps": reps, "tokens": cfg.max_new_tokens}


if __name__ == "__main__":
    main()
