"""How much the cost model's loop overheads move from one measurement to the next.

    selfspec-inspect overhead-spread results/optuna/qwen2.5-coder-0.5b-default.db \
        [--name qwen2.5-coder-0.5b-default] [--times 5] [--reps 3] [--dtype bfloat16] [--out results/overhead_spread.jsonl]

The search's cost model adds to its isolated forwards what the decoding loop adds around them (``draft_step``, and
``verify/<format>`` after each weight format's draft steps beside their pooled ``verify``, in
:func:`selfspec.search.costs.loop_overheads`), measured from short real runs. This script runs that
measurement ``--times`` times in one process, on the study's context (its first calibration prompt and continuation,
as the search measures it) and over the draft weight formats the study's cost model measured, each time against the
study's saved cost model (so only the loop runs differ between the times). It prints each time's overheads and their
spread, and appends one JSON line to --out with the commit, so the code of two commits can be compared on one
machine (run it from a checkout of each).
"""

from __future__ import annotations

import argparse
import statistics
import time

from selfspec.provenance import append_row
from selfspec.search.calibration import replay_study
from selfspec.search.costs import formats_of, loop_overheads


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect overhead-spread", description=__doc__.split("\n\n")[0])
    ap.add_argument("study", help="the study's storage (.db or .journal)")
    ap.add_argument("--name", help="the study's name (default: the file's stem)")
    ap.add_argument("--times", type=int, default=5, help="measurements of the loop overheads")
    ap.add_argument("--reps", type=int, default=3,
                    help="repetitions per measurement (the search's: its cost_reps // 2, 3 by default)")
    ap.add_argument("--dtype", default="bfloat16", help="the model's dtype, as the search ran it")
    ap.add_argument("--out", default="results/overhead_spread.jsonl")
    args = ap.parse_args(argv)
    name, saved, costs, lm = replay_study(args.study, args.name, args.dtype)
    context = saved["key"]["prompts"][0] + saved["continuations"][0]
    formats = formats_of(costs)
    rows = []
    for i in range(args.times):
        t0 = time.perf_counter()
        # the search measures them on the first half of its context (selfspec.search.costs.measure_costs)
        o = loop_overheads(lm.model, context[: max(len(context) // 2, 1)], costs, formats, lm.eos_ids,
                           reps=args.reps)
        # the pooled verify overhead, and each weight format's (the one the cost model prices its drafts with)
        verify = {f"{name}_ms": 1e3 * v for name, v in o.items() if name == "verify" or name.startswith("verify/")}
        rows.append({"draft_step_ms": 1e3 * o["draft_step"], **verify, "seconds": time.perf_counter() - t0})
        each = ", ".join(f"{k[:-3]} {v:+.1f} ms" for k, v in verify.items())
        print(f"{i + 1}/{args.times}: draft step {rows[-1]['draft_step_ms']:+.1f} ms, {each} ({rows[-1]['seconds']:.0f} s)",
              flush=True)
    keys = [k for k in rows[0] if k.endswith("_ms")]
    spread = {k: {"sd": statistics.stdev(r[k] for r in rows) if len(rows) > 1 else float("nan"),
                  "min": min(r[k] for r in rows), "max": max(r[k] for r in rows)} for k in keys}
    for k, v in spread.items():
        print(f"{k}: sd {v['sd']:.1f}, range {v['min']:+.1f} .. {v['max']:+.1f}")
    record = {"study": name, "storage": args.study,
              "dtype": args.dtype, "t_full_ms": 1e3 * costs.t_full, "formats": len(formats), "reps": args.reps, "times": rows,
              "spread": spread}
    append_row(args.out, record, echo=False)
    print(f"appended to {args.out}")

