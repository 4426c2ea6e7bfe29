"""``selfspec-inspect <subcommand>``: diagnostics of searches and evaluation runs.

Each subcommand reads a study (``results/optuna/*.db``) or an evaluation run (``results/runs/<name>``), prints what
it finds, and the ones that measure append one JSON line with its provenance to a results file:

    round-costs      where a draft's decode time goes, against the search's cost model on the same rounds
    overhead-spread  how much the cost model's loop overheads move from one measurement to the next
    tree-bound       how far a draft tree can go past the chain: simulated tree variants and the oracle, priced
    route-bounds     the best case of each route to a cheaper draft (per-token exit, a second level, fewer bits,
                     long contexts), priced before it is built
    stop-rules       where a model draft should stop: rules on its own probabilities and on what else the loop
                     knows, against the stopping oracle
    skip-scan        whether any sublayer pays skipped on top of a draft: each one simulated and priced, greedily
    match-rates      which methods' outputs equal which, per task set of a run
    paired-ratio     any method's speed over any other's in a run, per task set, with a paired 95% interval

``selfspec-inspect <subcommand> --help`` gives each one's options.
"""

from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "round-costs": "round_costs",
    "overhead-spread": "overhead_spread",
    "tree-bound": "tree_bound",
    "route-bounds": "route_bounds",
    "stop-rules": "stop_rules",
    "skip-scan": "skip_scan",
    "match-rates": "match_rates",
    "paired-ratio": "paired_ratio",
}


def main(argv: list[str] | None = None) -> int:
    from selfspec.errors import SelfSpecError

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    name, *rest = argv
    if name not in SUBCOMMANDS:
        print(f"selfspec-inspect: unknown subcommand {name!r}; one of: {', '.join(SUBCOMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"selfspec.inspect.{SUBCOMMANDS[name]}")
    try:
        module.main(rest)
    except SelfSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0
