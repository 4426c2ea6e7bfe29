"""What turning one row of logits into a token costs: our sampler against a full sort + multinomial, and our greedy
choice against torch's argmax on the model's bf16 logits.

    python scripts/sampler_bench.py [--model qwen2.5-coder-0.5b] [--dataset humaneval] [--temperature 0.6] [--top-p 0.95]

Takes the model's real logit rows (one forward over a calibration prompt, its last 32 positions),
then times, round-robin so load changes hit both alike, the median per-row cost (and the range
of the repetitions' paired ratios) of
(a) ``selfspec.engine.sampling``: top-p by a partial top-k, a draw by inverting the CDF, and
(b) the reference it replaced: a full sort of the vocabulary for top-p and ``torch.multinomial``.
Both keep the same tokens up to ties at the nucleus' edge (checked here row by row). Then, on the same rows in the
model's dtype, the greedy choice: ``selfspec.engine.sampling.greedy_ids`` (bf16 compared in fp32) against ``argmax``
on bf16, one row at a time (a step's) and 6 at a time (a verify's), with the same ids checked. Prints and appends one
JSON line to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.engine.sampling import SamplingParams, greedy_ids, probs_from_logits, sample
from selfspec.provenance import append_row, git_commit, machine_fingerprint


def reference(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Full sort for top-p, then torch.multinomial (the sampler before this change)."""
    logits = logits.float() / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = logits.softmax(-1)
    return probs, int(torch.multinomial(probs, 1, generator=generator))


def time_greedy(native: torch.Tensor, reps: int) -> dict:
    """ms per row of the greedy choice on ``native`` logit rows (the model's dtype): ours and torch's argmax, on one
    row at a time and on blocks of 6, round-robin; and whether both chose the same ids."""
    blocks = [native[i:i + 6] for i in range(0, len(native) - 5, 6)]
    ways = {"ours": greedy_ids, "argmax": lambda x: x.argmax(-1)}
    times: dict[str, list[float]] = {f"{name} {shape}": [] for name in ways for shape in ("1 row", "6 rows")}
    with torch.inference_mode():
        for rep in range(reps + 1):
            for name, f in (ways.items() if rep % 2 else reversed(ways.items())):
                for shape, parts in (("1 row", list(native)), ("6 rows", blocks)):
                    t0 = time.perf_counter()
                    for x in parts:
                        f(x)
                    if rep:
                        times[f"{name} {shape}"].append((time.perf_counter() - t0) / len(native))
    same = all(torch.equal(greedy_ids(x), x.argmax(-1)) for x in [native, *blocks])
    return {"dtype": str(native.dtype).removeprefix("torch."), "same_ids": same,
            "ms_per_row": {name: 1000 * statistics.median(t) for name, t in times.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dataset", default="humaneval", help="the calibration prompt's task set")
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default="results/sampler.jsonl")
    args = ap.parse_args()
    lm = load_model(args.model)
    prompt = calibration_prompts(lm.tokenizer, [args.dataset], 1)[0]
    with torch.inference_mode():
        native = lm.model(input_ids=torch.tensor([prompt])).logits[0, -32:]
    rows = native.float()
    params = SamplingParams(args.temperature, 0, args.top_p)
    g = torch.Generator().manual_seed(0)
    # tokens of equal probability at the nucleus' edge may be kept by one and dropped by the other
    # (a tie broken in another order): count the rows with the same kept set, and compare kept mass
    same_rows, same_sizes, mass_gap = 0, True, 0.0
    for r in rows:
        ours, ref = probs_from_logits(r, params) > 0, reference(r, params, g)[0] > 0
        same_rows += int(torch.equal(ours, ref))
        p = (r.float() / params.temperature).softmax(-1)
        same_sizes &= int(ours.sum()) == int(ref.sum())
        mass_gap = max(mass_gap, abs(float(p[ours].sum() - p[ref].sum())))
    times: dict[str, list[float]] = {"ours": [], "reference": []}
    with torch.inference_mode():
        for rep in range(args.reps + 1):
            for name in (("ours", "reference") if rep % 2 else ("reference", "ours")):
                t0 = time.perf_counter()
                for r in rows:
                    if name == "ours":
                        sample(probs_from_logits(r, params), g)
                    else:
                        reference(r, params, g)
                if rep:  # the first round warms up
                    times[name].append((time.perf_counter() - t0) / len(rows))
    ms = {name: 1000 * statistics.median(t) for name, t in times.items()}
    greedy = time_greedy(native, args.reps)
    # the spread: each repetition's paired ratio (both timed back to back in the same round)
    paired = [ref / ours for ref, ours in zip(times["reference"], times["ours"])]
    rec = {"script": "sampler_bench", "model": args.model, "vocab": rows.shape[-1], "temperature": args.temperature,
           "top_p": args.top_p, "reps": args.reps, "ms_per_row": ms, "ratio": ms["reference"] / ms["ours"],
           "ratio_min_max": [min(paired), max(paired)],
           "rows": len(rows), "rows_same_support": same_rows,
           "same_sizes": same_sizes, "max_kept_mass_gap": mass_gap, "greedy": greedy,
           "threads": torch.get_num_threads(),
           "git_commit": git_commit(),
           "machine": machine_fingerprint()}
    print(json.dumps(rec))
    append_row(args.out, rec, echo=False)


if __name__ == "__main__":
    main()
