"""Measure draft-path settings on calibration prompts: acceptance, draft cost, speedup over AR.

    python scripts/measure_draft.py --model qwen2.5-coder-1.5b --datasets gsm8k humaneval \
        --setting "plan=empty weights=int4 head=16384 k=4" --setting "weights=int8 k=3 adaptive=1"

Each setting is a space-separated list of key=value: plan (a draft or plan file, `empty`, or `default`
for results/plans/<model>-default.json: its options, k, k_max, adaptive exit and threshold unless given), any
draft option by its name (selfspec.draft.path.DraftOptions: weights, head_ids, head_weights, head_rescore,
int4_fit, ...) or by a short name: group (group_size), head (head_tokens, 0 = full), copy (copy_tokens, 0 = k),
cands (copy_candidates), branch (branch_below), nodes (tree_nodes); and k, k_max, adaptive (0|1), threshold,
rows (padded forward rows; the CPU's default, as decoding runs).
Prompts are the datasets' *calibration* samples (never the eval ones). AR and each setting
run interleaved per prompt after a warm-up (selfspec.engine.harness); the ratio of total tokens/s is printed and
appended as one JSON line to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
import typing

from selfspec import DecodeConfig, DecodeStats, SkipPlan
from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.harness import interleaved, recording
from selfspec.kernels.packed import default_rows
from selfspec.provenance import append_row, git_commit
from selfspec.search.retime import plan_runner

ALIASES = {"group": "group_size", "head": "head_tokens", "copy": "copy_tokens", "cands": "copy_candidates",
           "branch": "branch_below", "nodes": "tree_nodes"}


def _value(text: str, kind: type):
    """A setting's text as ``kind``: 0/1 or true/false for a bool."""
    if kind is bool:
        if text.lower() not in ("0", "1", "true", "false"):
            raise SystemExit(f"expected 0 or 1, got {text!r}")
        return text.lower() in ("1", "true")
    return kind(text)


def parse(setting: str, model: str, num_layers: int) -> tuple[SkipPlan, DraftOptions, dict]:
    """A setting's plan, draft options and decoding keys: a draft file's (plan=<file>), each key given overriding it."""
    kv = dict(item.split("=", 1) for item in setting.split())
    plan_arg = kv.pop("plan", "default")
    if plan_arg == "empty":
        spec = DraftSpec(SkipPlan(num_layers))
    else:
        spec = DraftSpec.load(f"results/plans/{model}-default.json" if plan_arg == "default" else plan_arg)
    decoding = {"k": spec.k, "k_max": spec.k_max, "adaptive": spec.adaptive, "threshold": spec.threshold,
                "rows": default_rows()}
    hints = typing.get_type_hints(DraftOptions)
    options = {f.name for f in dataclasses.fields(DraftOptions)}
    chosen = {}
    for key, text in kv.items():
        name = ALIASES.get(key, key)
        if name in decoding:
            decoding[name] = _value(text, type(decoding[name]))
        elif name in options:
            chosen[name] = _value(text, hints[name])
        else:
            raise SystemExit(f"unknown key {key!r} in setting {setting!r}: plan, {', '.join(decoding)}, "
                             f"{', '.join(ALIASES)} or a draft option ({', '.join(sorted(options))})")
    return spec.plan, dataclasses.replace(spec.options, **chosen), decoding


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--datasets", nargs="+", default=["gsm8k", "humaneval"])
    ap.add_argument("--prompts", type=int, default=2, help="calibration prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--setting", action="append", required=True)
    ap.add_argument("--out", default="results/draft_settings.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    prompts = calibration_prompts(lm.tokenizer, args.datasets, args.prompts)
    n_layers = lm.num_layers
    for setting in args.setting:
        plan, opts, dec = parse(setting, args.model, n_layers)
        t0 = time.perf_counter()
        path = DraftPath(lm.model, plan, opts, stop_ids=lm.eos_ids)
        build_s = time.perf_counter() - t0
        cfg = DecodeConfig(max_new_tokens=args.max_new_tokens, fallback=False, **dec)
        outputs: dict[str, list[list[int]]] = {"ar": [], "sp": []}
        runs = {"ar": recording(plan_runner(lm.model, lm.eos_ids, None, cfg), outputs["ar"]),
                "sp": recording(plan_runner(lm.model, lm.eos_ids, plan, cfg, draft=path), outputs["sp"])}
        per_rep = interleaved(runs, prompts, reps=1, warmup_tokens=8)
        ar, sp = (DecodeStats.merged(per_rep[name]) for name in ("ar", "sp"))
        a, t = ar.summary(), sp.summary()
        step = ar.total_time / ar.new_tokens  # seconds per AR token: the unit of the cost ratios below
        match = sum(x == y for x, y in zip(outputs["ar"], outputs["sp"]))
        res = {
            "setting": setting, "model": args.model, "datasets": args.datasets, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "plan": plan.describe(),
            "options": dataclasses.asdict(opts), "decoding": dec, "ar_tok_s": round(a["tokens_per_s"], 3),
            "spec_tok_s": round(t["tokens_per_s"], 3), "speedup": round(t["tokens_per_s"] / a["tokens_per_s"], 3),
            "acceptance": round(t["acceptance_rate"], 3), "tokens_per_round": round(t["mean_accepted_length"], 3),
            "draft_step_over_ar_step": round(sp.draft_time / max(sp.drafted, 1) / step, 3),
            "verify_over_ar_step": round(sp.verify_time / max(sp.rounds, 1) / step, 3),
            "copy_rounds": sp.copy_rounds, "tree_rounds": sp.tree_rounds,
            "nodes_per_tree_round": round(t["nodes_per_tree_round"], 2), "tree_wins": sp.tree_wins,
            "identical": f"{match}/{len(prompts)}",
            "extra_mb": round(path.extra_bytes / 2**20), "build_s": round(build_s, 1), "git_commit": git_commit(),
        }
        print(json.dumps(res), flush=True)
        append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
