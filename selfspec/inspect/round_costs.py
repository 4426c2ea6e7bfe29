"""Where a draft's decode time goes, set against the search's cost model on the very rounds it predicts.

    selfspec-inspect round-costs results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v8.db [--top 3] [--draft plan.json ...] \
        [--prompts 4] [--tokens 32] [--reps 3] [--dtype bfloat16] [--remeasure]

Times our AR and each draft (the study's best few by prediction, each one's twin with no sublayer skipped, and
any draft files given) on the study's re-timing prompts (calibration prompts spread over the list, as the search
re-times), interleaved after a warm-up in rotating order. Each draft's rounds are simulated on AR's tokens of
those runs and priced by the study's cost model. Per draft it prints the rounds simulated and run, the seconds
of each part the loop clocks (draft steps, verify passes, plain steps, and the unclocked rest), measured (median
over repetitions) and modelled, and the decode speedup measured (median and range of the paired ratios) and
predicted. Appends one JSON line to --out. The study's cost model must have been measured on this machine
(the search re-measures it when resumed elsewhere); the script refuses otherwise. ``--remeasure`` prices the
rounds with a cost model measured now, by the code checked out, over what the timed drafts use.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import optuna

from selfspec.assets.models import load_model
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.harness import interleaved, paired_ratios, recording
from selfspec.errors import SelfSpecError
from selfspec.kernels.packed import kernels_label
from selfspec.provenance import append_row, machine_fingerprint
from selfspec.search.calibration import study_calibration
from selfspec.search.costs import CostModel, costs_for_drafts
from selfspec.search.retime import AR, plan_runner, spec_runner
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import SearchSpace
from selfspec.search.study import top_drafts
from selfspec.search.variants import skip_free, spread
from selfspec.search.workers import open_storage

PARTS = ("draft", "verify", "plain")


def drafts_of(study_path: str, name: str, num_layers: int, model: str, top: int, files: list[str]) -> list[DraftSpec]:
    """The study's ``top`` drafts by prediction, each followed by its skip-free twin, then the draft files."""
    study = optuna.load_study(study_name=name, storage=open_storage(study_path))
    out: list[DraftSpec] = []
    for r in top_drafts(study, SearchSpace(num_layers), top, model):
        out += [r.spec, skip_free(r.spec)]
    out += [DraftSpec.load(f) for f in files]
    unique: dict[tuple, DraftSpec] = {}
    for d in out:
        unique.setdefault(d.key, d)
    return list(unique.values())


def measured_parts(stats) -> dict[str, float]:
    """Seconds of each part in one repetition's merged stats; ``rest``: decode time the loop does not clock apart."""
    parts = {"draft": stats.draft_time, "verify": stats.verify_time, "plain": stats.step_time}
    parts["rest"] = stats.total_time - stats.prefill_time - sum(parts.values())
    return parts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect round-costs", description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="the study's storage (.db or .journal)")
    ap.add_argument("--name", help="the study's name (default: the file's stem)")
    ap.add_argument("--top", type=int, default=3, help="the study's best drafts by prediction to time")
    ap.add_argument("--draft", action="append", default=[], help="a draft file to time as well (repeatable)")
    ap.add_argument("--prompts", type=int, default=4, help="calibration prompts, spread over the list")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype, as the search ran it")
    ap.add_argument("--remeasure", action="store_true",
                    help="price the rounds with a cost model measured now by this code (over what the drafts use) "
                         "instead of the study's")
    ap.add_argument("--out", default="results/round_costs.jsonl")
    args = ap.parse_args(argv)
    name = args.name or Path(args.study).stem
    saved = study_calibration(args.study, name)
    costs = CostModel.from_dict(saved["costs"])
    if not args.remeasure and costs.machine != machine_fingerprint():
        raise SelfSpecError(f"the study's cost model was measured on another machine ({costs.machine}); resume the "
                            "search here first (it re-measures the cost model), then run this again")
    lm = load_model(saved["key"]["model"], dtype=args.dtype)
    prompts = [saved["key"]["prompts"][i] for i in spread(len(saved["key"]["prompts"]), args.prompts)]
    drafts = drafts_of(args.study, name, lm.num_layers, lm.name, args.top, args.draft)
    if args.remeasure:
        print("measuring the cost model", file=sys.stderr, flush=True)
        costs = costs_for_drafts(lm, saved["key"]["prompts"][0] + saved["continuations"][0], drafts)
    outputs: list[list[int]] = []
    base = DecodeConfig(max_new_tokens=args.tokens, fallback=False)
    runs = {AR: recording(plan_runner(lm.model, lm.eos_ids, None, base), outputs)}
    for i, spec in enumerate(drafts):
        runs[f"draft{i}"] = spec_runner(lm.model, lm.eos_ids, spec, base)
    per_rep = interleaved(runs, prompts, args.reps, warmup_tokens=4)
    sim = RoundSimulator(lm.model, prompts, outputs[: len(prompts)], lm.eos_ids)
    ar_rest = statistics.median(measured_parts(s)["rest"] for s in per_rep[AR])
    ar_step = statistics.median(s.step_time / max(s.plain_steps, 1) for s in per_rep[AR])
    print(f"{len(prompts)} prompts x {args.tokens} tokens, {args.reps} reps; {kernels_label(True)}; AR: a plain step "
          f"{ar_step * 1e3:.1f} ms measured / {(costs.t_full + costs.overhead.get('plain_step', 0.0)) * 1e3:.1f} ms "
          f"modelled, unclocked rest {ar_rest:.2f} s")
    rows = []
    for i, spec in enumerate(drafts):
        counts = sim.simulate(spec)
        model_parts = costs.breakdown(counts, spec)
        reps = per_rep[f"draft{i}"]
        meas = {k: statistics.median(measured_parts(s)[k] for s in reps) for k in (*PARTS, "rest")}
        ratios = paired_ratios(per_rep, f"draft{i}", AR, "tpot_s")
        last = reps[-1]
        row = {"draft": spec.describe(), "adaptive": spec.adaptive,
               "rounds": {"simulated": {"rounds": counts.rounds, "copy": sum(counts.copy_rounds.values()),
                                        "plain": counts.plain_steps, "drafted": counts.drafted, "accepted": counts.accepted},
                          "measured": {"rounds": last.rounds, "copy": last.copy_rounds, "plain": last.plain_steps,
                                       "drafted": last.drafted, "accepted": last.accepted}},
               "seconds": {"measured": meas, "modelled": model_parts},
               "decode_speedup": {"predicted": costs.predicted_speedup(counts, spec),
                                  "measured": statistics.median(ratios), "range": [min(ratios), max(ratios)]}}
        rows.append(row)
        sim_r, run_r = row["rounds"]["simulated"], row["rounds"]["measured"]
        print(f"\n{spec.describe()}\n  rounds simulated / run: " + ", ".join(f"{k} {sim_r[k]} / {run_r[k]}" for k in sim_r))
        print("  seconds measured / modelled: " + ", ".join(f"{k} {meas[k]:.2f} / {model_parts[k]:.2f}" for k in PARTS)
              + f", unclocked rest {meas['rest']:.2f}")
        sp = row["decode_speedup"]
        print(f"  decode speedup measured {sp['measured']:.2f}x ({sp['range'][0]:.2f}-{sp['range'][1]:.2f}x over the "
              f"repetitions), predicted {sp['predicted']:.2f}x")
    record = {"study": name, "storage": args.study, "cost_model": "measured now" if args.remeasure else "the study's",
              "kernels": kernels_label(True), "dtype": args.dtype, "prompts": len(prompts),
              "tokens": args.tokens, "reps": args.reps,
              "ar": {"plain_step_s": ar_step, "modelled_plain_step_s": costs.t_full + costs.overhead.get("plain_step", 0.0),
                     "rest_s": ar_rest}, "drafts": rows,
              **({"costs": costs.to_dict()} if args.remeasure else {})}
    append_row(args.out, record, echo=False)
    print(f"\nappended to {args.out}")

