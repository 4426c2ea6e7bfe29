"""Does padding one-token forwards to a few rows make decoding faster? (``decoding.rows``)

    python scripts/padded_rows.py [--model qwen2.5-coder-1.5b] [--rows 1 4 6] [--draft results/plans/...json]

Runs our autoregressive loop with each ``rows`` setting (and, with ``--draft``, self-speculative
decoding with that draft at each setting) on calibration prompts of the four task sets,
interleaved after a warm-up, ``--reps`` times. Prints and appends one JSON line to --out:
tokens/s per setting, each setting's speedup over ``rows=1`` autoregressive (median over
repetitions, with the min..max), and how many outputs equal the ``rows=1`` output
(bf16 kernels over a different row count can round differently).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.harness import interleaved, recording
from selfspec.provenance import append_row, git_commit, machine_fingerprint
from selfspec.search.retime import plan_runner, spec_runner

TASKS = ["humaneval", "gsm8k", "mtbench", "summarization"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 6])
    ap.add_argument("--draft", default=None, help="a draft file: also time self-speculative decoding with it")
    ap.add_argument("--prompts", type=int, default=1, help="calibration prompts per task set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="results/padded_rows.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    prompts = calibration_prompts(lm.tokenizer, TASKS, args.prompts)
    base = DecodeConfig(max_new_tokens=args.max_new_tokens, fallback=False)
    spec = DraftSpec.load(args.draft) if args.draft else None
    outputs: dict[str, list[list[int]]] = {}
    runs = {}
    for rows in args.rows:
        cfg = replace(base, rows=rows)
        outputs[f"ar/rows={rows}"] = []
        runs[f"ar/rows={rows}"] = recording(plan_runner(lm.model, lm.eos_ids, None, cfg), outputs[f"ar/rows={rows}"])
        if spec is not None:
            outputs[f"spec/rows={rows}"] = []
            runs[f"spec/rows={rows}"] = recording(spec_runner(lm.model, lm.eos_ids, spec, cfg),
                                                  outputs[f"spec/rows={rows}"])
    per_rep = interleaved(runs, prompts, reps=args.reps, warmup_tokens=8)
    ref_name = f"ar/rows={args.rows[0]}"
    ref = [r.summary()["tokens_per_s"] for r in per_rep[ref_name]]
    res = {"model": args.model, "tasks": TASKS, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "reps": args.reps, "draft": args.draft, "baseline": ref_name, "settings": {}}
    n_ref = len(outputs[ref_name])
    for name, reps in per_rep.items():
        tps = [r.summary()["tokens_per_s"] for r in reps]
        ratios = sorted(t / b for t, b in zip(tps, ref))
        same = sum(a == b for a, b in zip(outputs[name], outputs[ref_name]))
        res["settings"][name] = {"tokens_per_s": round(sorted(tps)[len(tps) // 2], 3),
                                 "speedup_median": round(ratios[len(ratios) // 2], 3),
                                 "speedup_range": [round(ratios[0], 3), round(ratios[-1], 3)],
                                 "same_as_baseline": f"{same}/{n_ref}"}
        print(f"{name:<14} {res['settings'][name]}", flush=True)
    res["machine"] = machine_fingerprint()
    res["git_commit"] = git_commit()
    append_row(args.out, res, echo=False)


if __name__ == "__main__":
    main()
