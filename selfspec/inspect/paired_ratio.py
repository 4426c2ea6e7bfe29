"""One method's speed over another's in an eval run, per task set, with the paired-bootstrap 95% interval.

    selfspec-inspect paired-ratio results/runs/tree_avx2_whole/qwen2.5-coder-1.5b self_speculative-tree8 \
        self_speculative-chain

The tables give each method's speedup over AR and, for ours, the ratio over the fastest transformers peer; this
gives the ratio of any two methods of the run (tokens over time of both on the same prompts, as the tables take
it; :func:`selfspec.eval.records.paired_speedup`) and their tokens a round, one line per task set folder, where
the run holds the four task sets the mean of their four ratios (as the headline takes it), then
one line for all the run's rows together ("all sets": tokens over time of every row, the bootstrap drawing from all
of them, so that a difference of a few percent that no set's 10 rows resolve can be bounded over the whole run).
``--decode`` takes the tokens after each request's first over the time after it instead: the prefill left out, which
over prompts of thousands of tokens is a large share of every method's time and the same for each. Each line also
gives the share of each method's time that went to the first token of a request (the prefill and the first step, the
same work for every method): what bounds a speedup over the whole request however fast the decode runs. ``--rounds``
adds what a round of each method cost over all the run's rows: its drafted tokens, its drafting and its verify time,
and the verify in plain steps of the run's baseline (its header's, as the tables take it); where the rows hold both
model-drafted rounds and copy rounds, a verify of each kind, fitted by least squares over the rows (each row's verify
time as so many of each kind of round): a copy's verify is wider than a model draft's. ``--decode-faster F`` asks
what if: the first method's time after each request's first token divided by ``F`` (its prefill and first step as
measured), for the end-to-end speedup that a route making its decode ``F`` times faster would give on these rows.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selfspec.engine.stats import DecodeStats
from selfspec.errors import SelfSpecError
from selfspec.eval.headline import SETS
from selfspec.eval.records import baseline_of, paired_speedup, read_jsonl, stats_of_row, summarize


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect paired-ratio", description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="an eval run's model folder: one folder per task set, each with samples.jsonl")
    ap.add_argument("method")
    ap.add_argument("base")
    ap.add_argument("--decode", action="store_true",
                    help="decode speed: tokens after each request's first over the time after it (no prefill)")
    ap.add_argument("--rounds", action="store_true",
                    help="what a round of each method cost over all rows: drafted tokens, drafting and verify time")
    ap.add_argument("--decode-faster", type=float, default=1.0, metavar="F",
                    help="what if: the first method's time after each request's first token divided by F")
    args = ap.parse_args(argv)
    if args.decode_faster <= 0:
        raise SelfSpecError(f"--decode-faster must be positive, got {args.decode_faster}")
    folders = sorted(p.parent for p in Path(args.run).glob("*/samples.jsonl"))
    if not folders:
        raise SelfSpecError(f"no */samples.jsonl under {args.run}")
    pooled: tuple[list[dict], list[dict]] = ([], [])
    plain: list[dict] = []  # each run's baseline rows, for its plain step time
    ratios: dict[str, float] = {}
    for folder in folders:
        header, rows = read_jsonl(folder / "samples.jsonl")
        plain.extend(r for r in rows if r.get("method") == baseline_of(header))
        mine, base = ([r for r in rows if r.get("method") == m] for m in (args.method, args.base))
        if not mine or not base:
            raise SelfSpecError(f"{folder}: no rows of {args.method if not mine else args.base}")
        mine = [faster(r, args.decode_faster) for r in mine]
        ratios[folder.name] = _line(folder.name, mine, base, args.method, args.base, args.decode)
        for kept, rs in zip(pooled, (mine, base)):  # one sample id per set and prompt
            kept.extend({**r, "sample_id": f"{folder.name}/{r['sample_id']}"} for r in rs)
    if all(name in ratios for name in SETS):  # as the headline takes it: the mean of the four sets' ratios
        print(f"{'mean of four':<16} {args.method} over {args.base}: {sum(ratios[n] for n in SETS) / len(SETS):.3f}x "
              f"({', '.join(SETS)})")
    if len(folders) > 1:
        _line("all sets", *pooled, args.method, args.base, args.decode)
    if args.rounds:
        base = DecodeStats.merged([stats_of_row(r) for r in plain]) if plain else None
        for name, rows in zip((args.method, args.base), pooled):
            print(_round_cost(name, rows, base))


def faster(row: dict, f: float) -> dict:
    """The row with its time after each request's first token divided by ``f``."""
    if f == 1.0:
        return row
    c = stats_of_row(row).counters()
    return {**row, "counters": {**c, "total_time": c["ttft"] + (c["total_time"] - c["ttft"]) / f}}


def _round_cost(name: str, rows: list[dict], base: DecodeStats | None) -> str:
    """One method's rounds over its rows: drafted tokens, drafting and verify time a round (ms), the verify in the
    plain steps of ``base`` (the baseline rows' merged counters)."""
    per_row = [stats_of_row(r) for r in rows]
    s = DecodeStats.merged(per_row)
    if not s.rounds:
        return f"rounds of {name}: none"
    verify = s.verify_time / s.rounds
    line = (f"rounds of {name}: {s.rounds} ({s.copy_rounds} copies), {s.drafted / s.rounds:.2f} drafted tokens, drafting "
            f"{1e3 * s.draft_time / s.rounds:.1f} ms and a verify {1e3 * verify:.1f} ms a round")
    step = base.step_time / base.plain_steps if base is not None and base.plain_steps else None
    if step:
        line += f" ({verify / step:.2f} of {base.method}'s steps)"
    kinds = _verify_by_kind(per_row)
    if kinds is not None:
        line += "; a verify after a model draft {:.1f} ms, after a copy {:.1f} ms".format(*(1e3 * t for t in kinds))
        if step:
            line += " ({:.2f} / {:.2f} steps)".format(*(t / step for t in kinds))
        # what a verify after a copy would save at a model draft's verify cost, and at one plain step
        decode = s.total_time - s.ttft
        if decode > 0 and kinds[1] > kinds[0]:
            saved = s.copy_rounds * (kinds[1] - kinds[0]) / decode
            line += f"; a copy's verify at a model draft's would save {saved:.1%} of the decode time"
            if step and kinds[1] > step:
                line += f", at one step {s.copy_rounds * (kinds[1] - step) / decode:.1%}"
    return line


def _verify_by_kind(stats: list[DecodeStats]) -> tuple[float, float] | None:
    """Least-squares times (model round, copy round) with each row's verify time = a * its model-drafted rounds + b *
    its copy rounds; None where the rows do not tell the two apart."""
    xs = [(s.rounds - s.copy_rounds, s.copy_rounds, s.verify_time) for s in stats if s.rounds]
    aa, ab, bb = (sum(x[i] * x[j] for x in xs) for i, j in ((0, 0), (0, 1), (1, 1)))
    ay, by = (sum(x[i] * x[2] for x in xs) for i in (0, 1))
    det = aa * bb - ab * ab
    if det <= 1e-9 * max(aa * bb, 1.0):
        return None
    return (ay * bb - by * ab) / det, (by * aa - ay * ab) / det


def _line(name: str, mine: list[dict], base: list[dict], method: str, base_name: str, decode: bool = False) -> float:
    """Print one set's ratio line; return the ratio."""
    ratio, lo, hi = paired_speedup(mine, base, decode=decode)
    if ratio is None:
        raise SelfSpecError(f"{name}: no sample that both {method} and {base_name} decoded")
    s = summarize(mine + base, base_name)
    lengths = " / ".join(f"{s[m]['mean_accepted_length']:.2f}" if s[m].get("rounds") else "-" for m in (method, base_name))
    what = "decode speed" if decode else "speed"
    firsts = " / ".join(f"{100 * _first_share(rows):.0f}%" for rows in (mine, base))
    print(f"{name:<16} {method} over {base_name} ({what}): {ratio:.3f}x (95% {lo:.3f}-{hi:.3f}); "
          f"tokens a round {lengths}; first token {firsts} of the time")
    return ratio


def _first_share(rows: list[dict]) -> float:
    """The share of the rows' time spent up to each request's first token."""
    s = DecodeStats.merged([stats_of_row(r) for r in rows])
    return s.ttft / s.total_time if s.total_time > 0 else float("nan")

