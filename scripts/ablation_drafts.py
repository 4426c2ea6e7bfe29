"""Write the paper-style ablation's drafts from a searched draft file, one file per row.

    python scripts/ablation_drafts.py results/plans/qwen2.5-coder-1.5b-tasks.json --out results/plans/ablation

Rows (``selfspec.search.pipeline.cumulative_variants``): the skip plan alone, + low-precision
weights, + cut head, + copy drafting, the searched draft (with its adaptive exit, if any), the searched draft
with no sublayer skipped; a lever the searched draft does not use adds no row. Then
``python experiments/evaluate.py +experiment=ablation`` decodes the eval rows with each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selfspec.draft.spec import DraftSpec
from selfspec.search.pipeline import cumulative_variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft", help="the searched draft file")
    ap.add_argument("--out", default="results/plans/ablation")
    args = ap.parse_args()
    spec = DraftSpec.load(args.draft)
    for name, variant in cumulative_variants(spec):
        path = variant.replace(measured={"ablation_of": args.draft}).save(Path(args.out) / f"{name}.json")
        print(f"{path}: {variant.describe()}")


if __name__ == "__main__":
    main()
