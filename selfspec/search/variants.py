"""Drafts derived from a found draft: the ablation's variants, the paper-style cumulative rows, its skip-free twin."""

from __future__ import annotations

from dataclasses import asdict

from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.model.plan import SkipPlan


def ablation_variants(spec: DraftSpec) -> list[tuple[str, DraftSpec]]:
    """The found draft, and the same draft without each lever it uses."""
    o, plan = spec.options, spec.plan
    out = [("found draft", spec)]
    if plan.n_skipped:
        out.append(("without skipping", skip_free(spec)))
    if o.weights != "model":
        out.append(("without low precision", spec.replace(options=_options(o, weights="model"))))
    if o.head_tokens:
        out.append(("without the cut head", spec.replace(options=_options(o, head_tokens=0, head_ids="lowest"))))
    if o.head_ids != "lowest":
        out.append(("the lowest ids as the head's base", spec.replace(options=_options(o, head_ids="lowest"))))
    if o.head_weights != "model":
        out.append(("without the quantized head", spec.replace(options=_options(o, head_weights="model", head_rescore=0))))
    if o.head_rescore:
        out.append(("without head rescoring", spec.replace(options=_options(o, head_rescore=0))))
    if not o.model_draft:  # copy only: without copying it would be plain decoding, so add the model draft instead
        out.append(("with model drafts", spec.replace(options=_options(o, model_draft=True))))
    elif o.ngram:
        out.append(("without copy drafting", spec.replace(options=_options(o, **_NO_COPY))))
    if o.min_ngram:
        out.append(("without shorter copies", spec.replace(options=_options(o, min_ngram=0))))
    if o.copy_per_match:
        out.append(("copies not cut by match length", spec.replace(options=_options(o, copy_per_match=0))))
    if o.tree:
        out.append(("a chain (no draft tree)", spec.replace(options=_options(o, copy_candidates=1, branch_below=0.0))))
    if spec.adaptive:
        out.append(("fixed k (no adaptive exit)", spec.replace(adaptive=False, threshold=0.5)))
    return out


def cumulative_variants(spec: DraftSpec, papers: DraftSpec | None = None) -> list[tuple[str, DraftSpec]]:
    """The paper-style ablation: the skip plan alone (the layer-skip papers' draft, at the found k), then
    each lever of the found draft added in turn (the adaptive exit last: it makes the searched draft),
    then the searched draft without skipping. A lever the draft does not use adds no row.

    ``papers``: the draft of a pure layer-skip search (model weights, full head, no copies), the papers'
    method as this search finds it. Its row replaces the skip plan alone, and one more row runs the searched
    draft's options on its skip plan. A searched draft that skips nothing needs it: its skip plan alone is the
    model drafting for itself, which saves nothing.
    """
    if papers is not None and papers.plan.num_layers != spec.plan.num_layers:
        raise ValueError(f"the layer-skip draft has {papers.plan.num_layers} layers, the searched one "
                         f"{spec.plan.num_layers}: they are drafts of different models")
    o = spec.options
    plain = DraftSpec(spec.plan, DraftOptions(), k=spec.k)
    steps = [("skip_only", plain if papers is None else papers),
             ("plus_low_precision", plain.replace(options=_options(plain.options, weights=o.weights,
                                                                    group_size=o.group_size))),
             ("plus_cut_head", plain.replace(options=_options(o, **_NO_COPY, copy_candidates=1, branch_below=0.0))),
             ("plus_copy", plain.replace(options=_options(o, copy_candidates=1, branch_below=0.0))),
             ("plus_tree", plain.replace(options=o))]
    out, seen = [], {spec.key}
    for name, variant in steps:
        if variant.key not in seen:
            seen.add(variant.key)
            out.append((name, variant))
    out.append(("searched", spec))
    if spec.plan.n_skipped:
        out.append(("searched_no_skip", skip_free(spec)))
    if papers is not None and (papers.plan.attn, papers.plan.mlp) != (spec.plan.attn, spec.plan.mlp):
        out.append(("searched_papers_skip", spec.replace(plan=papers.plan)))
    return out


def skip_free(spec: DraftSpec) -> DraftSpec:
    """The same draft with no sublayer skipped: its options and length policy alone."""
    return spec.replace(plan=SkipPlan(spec.plan.num_layers, model=spec.plan.model))


# the options a draft with no copy drafting sets (the copy settings need an n-gram size)
_NO_COPY = {"ngram": 0, "copy_tokens": 0, "min_ngram": 0, "copy_per_match": 0, "copy_fallback": 0, "model_draft": True}


def _options(o: DraftOptions, **changes) -> DraftOptions:
    return DraftOptions(**{**asdict(o), **changes})


def spread(n_items: int, n: int) -> list[int]:
    """``n`` indices spread evenly over ``n_items`` items (all of them when ``n >= n_items``).

    The search re-times and checks held out on a few prompts: spread over a prompt list made of
    blocks (the ``tasks`` mix: each set's rows in turn), they sample every block, not the first one.
    """
    if n >= n_items:
        return list(range(n_items))
    return [i * n_items // n for i in range(n)]
