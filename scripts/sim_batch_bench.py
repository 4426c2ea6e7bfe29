"""What simulating the calibration prompts side by side, and lazy rows, save per search trial.

    python scripts/sim_batch_bench.py results/optuna/qwen2.5-coder-1.5b-tasks.db qwen2.5-coder-1.5b-tasks \
        [--trials 12] [--batches 1 4 12] [--rows whole lazy] [--dtype bfloat16] [--out results/sim_batch.jsonl]

Takes a committed study's calibration prompts and continuations and the drafts of its first
``--trials`` finished trials (the drafts a real search scores), and times the round simulation of
each draft over all prompts, ``batch`` prompts per batched forward, as the search's objective runs
it (:class:`~selfspec.search.study.PredictedObjective`, without pruning), with each chain round's
chunk drafted whole or one position a forward up to its first miss (``--rows``: the simulator's
``lazy``). Every setting (batch size x rows) runs on the same drafts in one process, the order
rotating from draft to draft, after a warm-up, each from an empty memo; each draft's quantized
copies are built once, outside the clock. Also checks that every setting gives the same round
counts as the first (bf16 rows computed in another batch may round differently, so a rare
difference is possible; it is counted, not hidden). Appends one JSON line to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import optuna
import torch

from selfspec.assets.models import load_model
from selfspec.engine.harness import rotated
from selfspec.provenance import append_row, git_commit, machine_fingerprint
from selfspec.search.calibration import study_calibration
from selfspec.search.rounds import RoundCounts
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import SearchSpace
from selfspec.search.workers import open_storage


def simulate_in_batches(sim: RoundSimulator, spec, path, batch: int) -> RoundCounts:
    total = RoundCounts()
    for _, counts in sim.batches(spec, path, batch):
        total.add(counts)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("storage")
    ap.add_argument("study")
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 12])
    ap.add_argument("--rows", nargs="+", choices=["whole", "lazy"], default=["whole"],
                    help="chain rounds drafted as whole chunks, or one position a forward up to the first miss")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype (the study's, e.g. float32 for tiny models)")
    ap.add_argument("--out", default="results/sim_batch.jsonl")
    args = ap.parse_args()
    saved = study_calibration(args.storage, args.study)
    study = optuna.load_study(study_name=args.study, storage=open_storage(args.storage))
    lm = load_model(saved["key"]["model"], dtype=args.dtype)
    space = SearchSpace(lm.num_layers)
    trials = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE][: args.trials]
    specs = [space.spec_of(t.params, lm.name) for t in trials]
    sim = RoundSimulator(lm.model, saved["key"]["prompts"], saved["continuations"], lm.eos_ids)
    settings = [(b, rows) for b in args.batches for rows in args.rows]
    label = {s: f"{s[0]}" if len(args.rows) == 1 else f"{s[0]}/{s[1]}" for s in settings}
    print(f"{lm.name}: {len(sim.prompts)} prompts, {len(specs)} drafts, settings {list(label.values())}", flush=True)
    sim.simulate(specs[0], prompts=[0])  # warm-up: one prompt
    seconds: dict[tuple, list[float]] = {s: [] for s in settings}
    rows: dict[tuple, list[int]] = {s: [] for s in settings}
    differ = {s: 0 for s in settings}
    for i, spec in enumerate(specs):
        path = sim.draft_path(spec)
        counts = {}
        for setting in rotated(settings, i):
            sim.memo.clear()  # every setting drafts every chunk itself
            sim.lazy = setting[1] == "lazy"
            before = sim.rows
            t0 = time.perf_counter()
            counts[setting] = simulate_in_batches(sim, spec, path, setting[0])
            seconds[setting].append(time.perf_counter() - t0)
            rows[setting].append(sim.rows - before)
        for setting in settings:
            differ[setting] += counts[setting] != counts[settings[0]]
        print(f"draft {i} (k={spec.k}{', adaptive' if spec.adaptive else ''}): "
              + ", ".join(f"{label[s]} {seconds[s][-1]:.2f} s" for s in settings), flush=True)
    first = settings[0]
    row = {"model": lm.name, "dtype": args.dtype, "prompts": len(sim.prompts), "drafts": len(specs), "study": args.study,
           "torch": torch.__version__, "threads": torch.get_num_threads(), "git_commit": git_commit(),
           "machine": machine_fingerprint(), "batches": {}}
    for setting in settings:
        ratios = [a / x for a, x in zip(seconds[first], seconds[setting])]
        row["batches"][label[setting]] = {
            "mean_s_per_draft": round(statistics.fmean(seconds[setting]), 3),
            "speedup_over_first": round(sum(seconds[first]) / sum(seconds[setting]), 3),
            "per_draft_speedup_min": round(min(ratios), 3), "per_draft_speedup_max": round(max(ratios), 3),
            "draft_positions_per_draft": round(statistics.fmean(rows[setting])),
            "drafts_whose_counts_differ_from_first": differ[setting],
        }
        print(f"{label[setting]}: {row['batches'][label[setting]]}", flush=True)
    append_row(args.out, row, echo=False)


if __name__ == "__main__":
    main()
