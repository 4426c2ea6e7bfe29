"""Does the engine keep its promises on a CUDA device? (The fast paths here are CPU kernels; this checks the rest.)

    python scripts/device_check.py [--device cuda] [--max-new-tokens 48] [--shape qwen2.5-coder-1.5b]

On the tests' seeded tiny Llama, Qwen2 and Gemma3 models (built in-process, nothing to download), on ``--device``:

- greedy self-speculative output against greedy AR in fp32, over three skip plans, k = 1, 3, 5 and five draft
  settings (the plan alone, copy drafting, a copy tree, a model-branching tree, the adaptive exit);
- the same in bf16 with the defaults (row-invariant attention; the device's linear kernels may still round a row
  by the forward's width: a match rate) and with ``row_invariant=False``;
- sampling (T 0.6, top-p 0.95): the same seed gives the same tokens, and tokens are in the vocabulary;
- int4 draft weights (CPU kernels) are refused with a clear error;
- the clock (CUDA events on a GPU) against a synchronized wall clock over an AR run.

With ``--shape``, a model of that checkpoint's shape with random bf16 weights (its config only: no weights are
read): what a full-depth forward over m tokens costs against one token (what draft trees rest on, on this device), and
our AR loop's tokens/s against transformers' ``generate`` on the same model, prompt and token count.

Prints a summary and appends one JSON line to ``--out``. ``--quick`` checks fewer settings (for the tests, on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from selfspec import DecodeConfig, SamplingParams, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import TINY_ARCHS, tiny_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.engine.stats import Clock
from selfspec.errors import SelfSpecError
from selfspec.provenance import append_row, cpu_name, git_commit

PROMPT = list(range(3, 20))  # the tests' prompt
LAYERS = 4
PLANS = {
    "attn1+mlp2": SkipPlan(LAYERS, attn=(1,), mlp=(2,)),
    "attn02+mlp13": SkipPlan(LAYERS, attn=(0, 2), mlp=(1, 3)),
    "layer3": SkipPlan.whole_layers(LAYERS, [3]),
}
DRAFTS = {  # name -> (draft options, adaptive exit)
    "plan": (DraftOptions(), False),
    "copy": (DraftOptions(ngram=1), False),
    "copy tree": (DraftOptions(ngram=1, copy_candidates=3), False),
    "model tree": (DraftOptions(branch_below=0.6), False),
    "adaptive": (DraftOptions(), True),
}
# a checkpoint's shape for --shape (its config.json's numbers): random weights, no download
SHAPES = {
    "qwen2.5-coder-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                               num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                               rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "qwen2.5-coder-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                               rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6),
}


def equality(model, max_new: int, ks, drafts, row_invariant: bool = True) -> dict:
    """How many self-speculative outputs equal AR's, over plans x k x draft settings."""
    same, total, misses = 0, 0, []
    for k in ks:
        cfg = DecodeConfig(max_new_tokens=max_new, k=k, fallback=False, row_invariant=row_invariant)
        ar = autoregressive(model, PROMPT, cfg).tokens
        for plan_name, plan in PLANS.items():
            for name in drafts:
                opts, adaptive = DRAFTS[name]
                run_cfg = DecodeConfig(max_new_tokens=max_new, k=k, fallback=False, adaptive=adaptive,
                                       row_invariant=row_invariant)
                out = self_speculative(model, PROMPT, plan, run_cfg, draft=DraftPath(model, plan, opts)).tokens
                total += 1
                if out == ar:
                    same += 1
                else:
                    first = next((i for i, (a, b) in enumerate(zip(out, ar)) if a != b), min(len(out), len(ar)))
                    misses.append(f"{plan_name} k={k} {name}: first difference at token {first}")
    return {"same": same, "runs": total, "misses": misses}


def sampling_is_seeded(model, max_new: int) -> bool:
    plan = PLANS["attn1+mlp2"]
    cfg = DecodeConfig(max_new_tokens=max_new, k=3, fallback=False, sampling=SamplingParams(0.6, top_p=0.95), seed=7)
    runs = [self_speculative(model, PROMPT, plan, cfg).tokens for _ in range(2)]
    vocab = model.get_output_embeddings().weight.shape[0]
    return runs[0] == runs[1] and all(0 <= t < vocab for t in runs[0])


def int4_refusal(model) -> str:
    try:
        DraftPath(model, PLANS["layer3"], DraftOptions(weights="int4"))
    except SelfSpecError as err:
        return f"refused: {err}"
    return "accepted"


def clock_agreement(model, max_new: int, device: torch.device) -> dict:
    """The decode loop's own clock (CUDA events on a GPU) against a synchronized wall clock, over one AR run."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    stats = autoregressive(model, PROMPT, DecodeConfig(max_new_tokens=max_new, fallback=False)).stats
    sync()
    wall = time.perf_counter() - t0
    return {"clock_s": stats.total_time, "wall_s": wall, "tokens": stats.new_tokens}


def shaped_model(shape: str, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape]), dtype=torch.bfloat16).eval()


def width_costs(model, device: torch.device, widths, reps: int, context: int = 512) -> dict:
    """Median time of a full-depth forward over m tokens after ``context`` tokens, and its ratio to one token."""
    clock = Clock(device)
    cache = PositionalKVCache(model, max_len=context + max(widths) + 1)
    ids = torch.randint(0, 1000, (context + max(widths),), device=device)
    times: dict[int, list[float]] = {m: [] for m in widths}
    with torch.inference_mode():
        forward_at(model, cache, ids[:context], 0, keep=1)
        for rep in range(reps + 1):
            for m in widths:
                t0 = clock.now()
                forward_at(model, cache, ids[context:context + m], context, keep=m)
                if rep:  # the first sweep warms up
                    times[m].append(clock.now() - t0)
    med = {m: statistics.median(v) for m, v in times.items()}
    return {"context": context, "reps": reps, "ms": {m: 1000 * t for m, t in med.items()},
            "ratio_to_one": {m: t / med[widths[0]] for m, t in med.items()}}


def ar_against_generate(model, device: torch.device, max_new: int, reps: int) -> dict:
    """Our AR loop against transformers' generate: same model, attention, prompt and token count, alternating, after a
    warm-up."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    prompt = list(range(1000, 1064))
    ids = torch.tensor([prompt], device=device)

    def ours() -> int:
        return len(autoregressive(model, prompt, DecodeConfig(max_new_tokens=max_new, fallback=False)).tokens)

    def generate() -> int:  # on our decode attention, as the evaluation harness runs it (selfspec.eval.hf)
        with torch.inference_mode(), decode_attention(model):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                 min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out.shape[1] - ids.shape[1]

    rates: dict[str, list[float]] = {"ours": [], "generate": []}
    for rep in range(reps + 1):
        for name, fn in (("ours", ours), ("generate", generate))[:: 1 if rep % 2 else -1]:
            sync()
            t0 = time.perf_counter()
            n = fn()
            sync()
            if rep:
                rates[name].append(n / (time.perf_counter() - t0))
    med = {name: statistics.median(v) for name, v in rates.items()}
    return {"max_new_tokens": max_new, "reps": reps, "tok_s": med,
            "tok_s_min_max": {name: [min(v), max(v)] for name, v in rates.items()},
            "ours_over_generate": med["ours"] / med["generate"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="one architecture, k=3, two draft settings")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="also time forwards by width and AR against generate on a random model of this shape")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="results/device_check.jsonl")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: this torch ({torch.__version__}) sees no CUDA device")
    archs = TINY_ARCHS[:1] if args.quick else TINY_ARCHS
    ks = (3,) if args.quick else (1, 3, 5)
    drafts = ("plan", "copy tree") if args.quick else tuple(DRAFTS)
    res: dict = {"device": str(device), "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
                 else cpu_name(), "cpu": cpu_name(), "torch": torch.__version__, "commit": git_commit(),
                 "max_new_tokens": args.max_new_tokens, "archs": {}}
    res["transformers"] = transformers.__version__
    for arch in archs:
        fp32 = tiny_model(arch, dtype=torch.float32, vocab_size=96).to(device)
        bf16 = tiny_model(arch, dtype=torch.bfloat16, vocab_size=96).to(device)
        row = {
            "fp32": equality(fp32, args.max_new_tokens, ks, drafts),
            "bf16": equality(bf16, args.max_new_tokens, ks, drafts),
            "bf16_not_invariant": equality(bf16, args.max_new_tokens, ks, drafts, row_invariant=False),
            "sampling_seeded": sampling_is_seeded(fp32, args.max_new_tokens),
            "int4": int4_refusal(fp32),
            "clock": clock_agreement(fp32, args.max_new_tokens, device),
        }
        if device.type != "cpu":  # the same tokens as on the CPU (fp32 AR, same seeded weights)?
            cpu = tiny_model(arch, dtype=torch.float32, vocab_size=96)
            cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, fallback=False)
            row["ar_same_as_cpu"] = autoregressive(cpu, PROMPT, cfg).tokens == autoregressive(fp32, PROMPT, cfg).tokens
        res["archs"][arch] = row
        print(f"{arch}: fp32 {row['fp32']['same']}/{row['fp32']['runs']} equal to AR, bf16 {row['bf16']['same']}/"
              f"{row['bf16']['runs']}, bf16 not row-invariant {row['bf16_not_invariant']['same']}/"
              f"{row['bf16_not_invariant']['runs']}; sampling "
              f"seeded {row['sampling_seeded']}; int4 {row['int4'][:60]}; clock {row['clock']['clock_s']:.3f} s "
              f"against wall {row['clock']['wall_s']:.3f} s" +
              (f"; AR as on CPU {row['ar_same_as_cpu']}" if "ar_same_as_cpu" in row else ""), flush=True)
        for what in ("fp32", "bf16", "bf16_not_invariant"):
            for miss in row[what]["misses"]:
                print(f"  {what}: {miss}")
    if args.shape:
        model = shaped_model(args.shape, device)
        res["shape"] = {"name": args.shape, "weights": "random bf16 (config only)",
                        "width": width_costs(model, device, [1, 2, 4, 6, 8, 12, 16, 32, 64], args.reps),
                        "ar_vs_generate": ar_against_generate(model, device, 64, args.reps)}
        w, g = res["shape"]["width"], res["shape"]["ar_vs_generate"]
        print(f"{args.shape} shape on {device}: forward over m tokens / over one: " +
              ", ".join(f"{m}: {r:.2f}" for m, r in w["ratio_to_one"].items()) + f" (one token {w['ms'][1]:.2f} ms)")
        print(f"our AR {g['tok_s']['ours']:.1f} tok/s, generate {g['tok_s']['generate']:.1f} tok/s: "
              f"{g['ours_over_generate']:.2f}x")
    append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
