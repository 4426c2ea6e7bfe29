"""``python -m selfspec.tables``: paper-style tables and figures from every ``samples.jsonl`` under ``--runs``.

Writes ``<experiment>.{md,tex,csv}`` per experiment name (the first folder under ``--runs``), each with the
command that reproduces it, its commits, dates and CPUs; ``methods.{md,csv}``: every method of every run side by
side; and the figures of :mod:`selfspec.eval.figures`. With ``--readme``, the README's headline block is
rewritten from ``headline.md``. Nothing is typed by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from selfspec.cli import take_interrupts
from selfspec.cli.config import conf_dir
from selfspec.eval.figures import write_figures
from selfspec.eval.headline import update_readme
from selfspec.eval.tables import load_runs, methods_overview, write_methods_overview, write_tables


def _command(name: str) -> str | None:
    """The command that reproduces experiment ``name``, where a config of that name exists."""
    if (conf_dir() / "experiment" / f"{name}.yaml").is_file():
        return f"python experiments/evaluate.py +experiment={name} logger=none"
    return None


def main(argv: list[str] | None = None) -> int:
    take_interrupts()
    ap = argparse.ArgumentParser(prog="python -m selfspec.tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", default="results/runs", help="folder searched for samples.jsonl files")
    ap.add_argument("--tables", default="results/tables", help="where .md/.tex/.csv go")
    ap.add_argument("--figures", default="results/figures", help="where PNG figures go")
    ap.add_argument("--studies", default="results/optuna", help="Optuna SQLite studies for the search figures")
    ap.add_argument("--no-figures", action="store_true")
    ap.add_argument("--readme", nargs="?", const="README.md", default=None,
                    help="rewrite the headline block of this README (default README.md) from headline.md")
    args = ap.parse_args(argv)
    runs = load_runs(Path(args.runs))
    if not runs:
        print(f"error: no samples.jsonl with results under {args.runs}", file=sys.stderr)
        return 2
    names = {r.experiment for r in runs}
    by_exp = write_tables(runs, Path(args.tables), {n: c for n in names if (c := _command(n))})
    for name, rows in by_exp.items():
        print(f"{args.tables}/{name}.{{md,tex,csv}}: {len(rows)} rows")
    overview = methods_overview(by_exp)
    write_methods_overview(overview, Path(args.tables) / "methods")
    print(f"{args.tables}/methods.{{md,csv}}: {len(overview)} rows")
    if args.readme:
        if "headline" not in by_exp:
            print(f"error: no headline run under {args.runs}: nothing to write into {args.readme}", file=sys.stderr)
            return 2
        update_readme(Path(args.readme), by_exp["headline"], (Path(args.tables) / "headline.md").read_text())
        print(f"{args.readme}: headline block rewritten")
    if not args.no_figures:
        for p in write_figures(by_exp, Path(args.studies), Path(args.figures)):
            print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
