"""``python -m selfspec.generate``: decode one prompt both ways and compare.

Runs the autoregressive baseline and self-speculative decoding on the same
model, prompt and cache code, prints both texts, the decoding statistics and
the speedup, and says whether the greedy outputs are token-identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from selfspec.assets.models import MODELS, encode_prompt, load_model
from selfspec.cli import take_interrupts
from selfspec.cli.config import default_model
from selfspec.cli.show import legend, pieces, render, save_png
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.harness import warm_up
from selfspec.engine.sampling import SamplingParams
from selfspec.errors import SelfSpecError
from selfspec.model.plan import SkipPlan
from selfspec.search.retime import plan_runner, spec_runner

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome."


PLAN_DIRS = ("outputs/plans", "results/plans")  # your own searches first, then the committed ones


def default_draft(model_name: str, num_layers: int) -> tuple[DraftSpec, str]:
    """The searched draft for the model (your own search's, else the committed one), else a simple heuristic."""
    for folder in PLAN_DIRS:
        found = Path(folder) / f"{model_name}-default.json"
        if found.is_file():
            spec = DraftSpec.load(found)
            if spec.plan.num_layers == num_layers:
                return spec, str(found)
    lo, hi = num_layers // 4, (3 * num_layers) // 4
    plan = SkipPlan(num_layers, attn=tuple(range(lo, hi, 2)), model=model_name)
    return DraftSpec(plan), "heuristic: attention of every other middle layer (run python -m selfspec.search for a real draft)"


def parse_layers(text: str | None) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise SelfSpecError(f"layer lists are comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m selfspec.generate", description=__doc__)
    ap.add_argument("--model", default=default_model(),
                    help=f"packaged ({', '.join(MODELS)}), folder or hub id (default: conf/base.yaml's)")
    ap.add_argument("--prompt", default=DEFAULT_PROMPT)
    ap.add_argument("--plan", help="draft (or skip plan) JSON; default: <model>-default.json in outputs/plans, "
                                   "then results/plans, else a heuristic")
    ap.add_argument("--skip-attn", help="comma-separated attention layers to skip (instead of --plan)")
    ap.add_argument("--skip-mlp", help="comma-separated MLP layers to skip (instead of --plan)")
    ap.add_argument("--k", type=int, default=None,
                    help="draft tokens per round, maximum when adaptive (default: the draft file's k)")
    ap.add_argument("--adaptive", action="store_true", default=None,
                    help="adaptive draft exit on low draft confidence (default: as the draft file says)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", help="where packaged models are cached (default ~/.cache/selfspec)")
    ap.add_argument("--json", action="store_true", help="print one JSON line with both summaries at the end")
    ap.add_argument("--show-sources", action="store_true",
                    help="mark each token of the answer by where it came from: copied, drafted and accepted, or the "
                         "verify pass's own (colours in a terminal, brackets elsewhere or with NO_COLOR set)")
    ap.add_argument("--sources-png", metavar="PATH", help="also draw the answer so marked into a PNG file")
    return ap


def main(argv: list[str] | None = None) -> int:
    take_interrupts()
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except SelfSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    if args.max_new_tokens < 1:
        raise SelfSpecError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    lm = load_model(args.model, dtype=args.dtype, cache_dir=args.cache_dir)
    if args.skip_attn or args.skip_mlp:
        plan = SkipPlan(lm.num_layers, parse_layers(args.skip_attn), parse_layers(args.skip_mlp), model=args.model)
        spec, plan_src = DraftSpec(plan), "command line"
    elif args.plan:
        spec, plan_src = DraftSpec.load(args.plan), args.plan
        spec.plan.check_model(lm.num_layers, lm.name)  # a draft of another model (even of the same depth) is refused
    else:
        spec, plan_src = default_draft(args.model, lm.num_layers)
    spec = spec.replace(k=args.k if args.k is not None else spec.k,
                        adaptive=args.adaptive if args.adaptive is not None else spec.adaptive)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
    cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed)
    ids = encode_prompt(lm.tokenizer, args.prompt)
    print(f"model {args.model} ({lm.num_layers} layers, {lm.info['dtype']}), prompt {len(ids)} tokens")
    print(f"draft {spec.describe()}  [{plan_src}]")
    runs = {"autoregressive": plan_runner(lm.model, lm.eos_ids, None, cfg),
            "self_speculative": spec_runner(lm.model, lm.eos_ids, spec, cfg)}
    warm_up(runs, ids, 4)  # neither timing pays first-call costs
    ar, sp = (run(ids, None) for run in runs.values())
    a, s = ar.stats.summary(), sp.stats.summary()
    print("\n--- self-speculative output ---")
    if args.show_sources:
        color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
        print(render(pieces(lm.tokenizer, sp.tokens), sp.sources, color))
        print("-------------------------------")
        print(legend(sp.sources, color))
    if args.sources_png:
        save_png(pieces(lm.tokenizer, sp.tokens), sp.sources, args.sources_png)
        print(f"{args.sources_png}: the answer with each token's source")
    else:
        print(lm.tokenizer.decode(sp.tokens, skip_special_tokens=True))
    print("-------------------------------")
    print(f"{'':22}{'autoregressive':>16}{'self_speculative':>18}")
    for key, fmt in (("new_tokens", "{:.0f}"), ("tokens_per_s", "{:.2f}"), ("ttft_s", "{:.3f}"),
                     ("tpot_s", "{:.4f}"), ("rounds", "{:.0f}"), ("acceptance_rate", "{:.3f}"),
                     ("mean_accepted_length", "{:.2f}")):
        print(f"{key:22}{fmt.format(a[key]):>16}{fmt.format(s[key]):>18}")
    speedup = s["tokens_per_s"] / a["tokens_per_s"]
    same = ar.tokens == sp.tokens
    print(f"speedup {speedup:.2f}x; outputs {'token-identical' if same else 'differ'}"
          + ("" if sampling.greedy else " (sampling: identical only in distribution)"))
    if s["fell_back_at"] is not None:
        print(f"note: speculation was slower than plain decoding here; fell back after {s['fell_back_at']} tokens")
    if args.json:
        print(json.dumps({"autoregressive": a, "self_speculative": s, "speedup": speedup, "identical": same}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
