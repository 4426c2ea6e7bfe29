"""Which methods' outputs equal which: per run folder, the share of samples with identical text.

    selfspec-inspect match-rates results/runs/headline [--pairs self_speculative:autoregressive ...]
        [--out outputs/headline_match.md]

Reads every ``samples.jsonl`` under the folder and, per task set, compares the outputs
(``output_sha256``: every turn's text) of each pair of methods on the samples both decoded
(in a run of several passes, each pass's output against the same pass's).
Without ``--pairs``: every method against every other. Writes a Markdown table to --out (if given).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from selfspec.eval.records import read_jsonl, row_key


def match_table(root: Path, pairs: list[tuple[str, str]] | None) -> list[dict]:
    rows = []
    for path in sorted(root.glob("**/samples.jsonl")):
        header, samples = read_jsonl(path)
        if header is None:
            continue
        outputs: dict[str, dict[tuple[str, int], str]] = {}
        for r in samples:
            if r.get("type", "sample") == "sample" and "output_sha256" in r:
                outputs.setdefault(r["method"], {})[row_key(r)] = r["output_sha256"]
        wanted = pairs or list(itertools.combinations(sorted(outputs), 2))
        for a, b in wanted:
            common = sorted(set(outputs.get(a, {})) & set(outputs.get(b, {})))
            same = sum(outputs[a][s] == outputs[b][s] for s in common)
            rows.append({"model": header.get("model"), "dataset": header.get("dataset"), "a": a, "b": b,
                         "same": same, "samples": len(common)})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="selfspec-inspect match-rates", description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--pairs", nargs="*", default=None, help="a:b method pairs (default: all pairs)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    pairs = [tuple(p.split(":", 1)) for p in args.pairs] if args.pairs else None
    rows = match_table(args.root, pairs)
    lines = ["| model | task set | method | equals | same output |", "|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dataset']} | {r['a']} | {r['b']} | {r['same']}/{r['samples']} |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        args.out.write_text(f"Outputs compared per sample (`selfspec-inspect match-rates {args.root}`):\n\n" + text)

