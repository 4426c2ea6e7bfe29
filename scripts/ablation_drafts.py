"""Write the paper-style ablation's drafts from a searched draft file, one file per row.

    python scripts/ablation_drafts.py <draft.json> --out <folder>

Rows (``selfspec.search.variants.cumulative_variants``): the skip plan alone, + low-precision
weights, + cut head, + copy drafting, the searched draft (with its adaptive exit, if any), the searched draft
with no sublayer skipped; a lever the searched draft does not use adds no row. Then
``python experiments/evaluate.py +experiment=ablation`` decodes the eval rows with each.

A searched draft that skips nothing has no skip plan of its own to ablate: pass ``--papers`` with the draft of
a pure layer-skip search (``search=skiponly``). It becomes the
skip-only row, and ``searched_papers_skip`` runs the searched draft's options on its skip plan:

    python scripts/ablation_drafts.py results/plans/qwen2.5-coder-1.5b-tasks-avx2-v6.json \
        --papers results/plans/qwen2.5-coder-1.5b-skiponly.json --out results/plans/ablation
"""

from __future__ import annotations

import argparse
from pathlib import Path

from selfspec.draft.spec import DraftSpec
from selfspec.search.variants import cumulative_variants


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("draft", help="the searched draft file")
    ap.add_argument("--out", default="results/plans/ablation")
    ap.add_argument("--papers", help="a pure layer-skip search's draft: the skip-only row (needed when the "
                                     "searched draft skips nothing)")
    args = ap.parse_args()
    spec = DraftSpec.load(args.draft)
    papers = DraftSpec.load(args.papers) if args.papers else None
    if papers is None and not spec.plan.n_skipped:
        print(f"note: {args.draft} skips no sublayer, so its skip-only row is the model drafting for itself; "
              "pass --papers with a pure layer-skip search's draft for the papers' method")
    made = {"ablation_of": args.draft, **({"papers_draft": args.papers} if papers else {})}
    for name, variant in cumulative_variants(spec, papers):
        path = variant.replace(measured=made).save(Path(args.out) / f"{name}.json")
        print(f"{path}: {variant.describe()}")


if __name__ == "__main__":
    main()
