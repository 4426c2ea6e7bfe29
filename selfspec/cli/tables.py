"""``python -m selfspec.tables``: paper-style tables and figures from every ``samples.jsonl`` under ``--runs``.

Writes ``<experiment>.{md,tex,csv}`` per experiment name (the first folder under
``--runs``), ``methods.{md,csv}`` when a ``main`` or ``baselines`` run exists, and
the figures of :mod:`selfspec.eval.figures`. Nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from selfspec.eval.figures import write_figures
from selfspec.eval.tables import (
    COMPARED,
    load_runs,
    method_comparison,
    write_method_comparison,
    write_tables,
)

HEADLINE_RUNS = ["baselines", "main_handpicked", "main", "fair", "tree", "main_peers"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m selfspec.tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="results/runs", help="folder searched for samples.jsonl files")
    ap.add_argument("--tables", default="results/tables", help="where .md/.tex/.csv go")
    ap.add_argument("--figures", default="results/figures", help="where PNG figures go")
    ap.add_argument("--studies", default="results/optuna", help="Optuna SQLite studies for the search figures")
    ap.add_argument("--no-figures", action="store_true")
    args = ap.parse_args(argv)
    runs = load_runs(Path(args.runs))
    if not runs:
        print(f"error: no samples.jsonl with results under {args.runs}", file=sys.stderr)
        return 2
    by_exp = write_tables(runs, Path(args.tables))
    for name, rows in by_exp.items():
        print(f"{args.tables}/{name}.{{md,tex,csv}}: {len(rows)} rows")
    if set(HEADLINE_RUNS) & set(by_exp):
        comparison = method_comparison(by_exp, HEADLINE_RUNS)  # a later run's number replaces an earlier one's
        write_method_comparison(comparison, COMPARED, Path(args.tables) / "methods")
        print(f"{args.tables}/methods.{{md,csv}}: {len(comparison)} rows")
    if not args.no_figures:
        for p in write_figures(by_exp, Path(args.studies), Path(args.figures)):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
