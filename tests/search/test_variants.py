"""Ablation and cumulative variants of a draft: each lever of the draft taken away, and added one by one."""

import pytest

from selfspec import SkipPlan
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.search.variants import ablation_variants, cumulative_variants

FULL = DraftSpec(SkipPlan(6, attn=(1, 3), mlp=(2,), model="m", provenance={"git_commit": "x"}),
                 DraftOptions(weights="int4", group_size=128, head_tokens=16384, ngram=3, copy_tokens=10),
                 k=4, adaptive=True, threshold=0.4, measured={"calibration": {"speedup": 1.5}})


def test_ablation_rows():
    names = [name for name, _ in cumulative_variants(FULL)]
    assert names == ["skip_only", "plus_low_precision", "plus_cut_head", "plus_copy", "searched", "searched_no_skip"]
    rows = dict(cumulative_variants(FULL))
    assert rows["skip_only"].options == DraftOptions() and rows["skip_only"].plan == FULL.plan
    assert rows["plus_copy"].options == FULL.options and not rows["plus_copy"].adaptive
    assert rows["searched_no_skip"].plan.n_skipped == 0 and rows["searched_no_skip"].options == FULL.options
    plain = DraftSpec(SkipPlan(6, attn=(1,)), k=2)  # no lever beyond skipping: no row repeats the searched one
    assert [n for n, _ in cumulative_variants(plain)] == ["searched", "searched_no_skip"]
    leave_one_out = dict(ablation_variants(FULL))
    assert leave_one_out["without low precision"].options.weights == "model"
    assert leave_one_out["without copy drafting"].options.ngram == 0


def test_a_skip_free_draft_is_ablated_against_the_papers_layer_skip_draft():
    found = DraftSpec(SkipPlan(6), DraftOptions(weights="int4", group_size=128, head_weights="int4", ngram=3,
                                                copy_tokens=10), k=3)
    papers = DraftSpec(SkipPlan(6, attn=(2, 4), mlp=(3,)), k=2, adaptive=True, threshold=0.4)
    rows = dict(cumulative_variants(found, papers))
    assert list(rows) == ["skip_only", "plus_low_precision", "plus_cut_head", "searched", "searched_papers_skip"]
    assert rows["skip_only"] == papers and rows["skip_only"].adaptive  # the layer-skip draft as searched
    assert rows["plus_low_precision"].plan.n_skipped == 0 and rows["plus_low_precision"].options.weights == "int4"
    both = rows["searched_papers_skip"]
    assert both.plan.attn == (2, 4) and both.options == found.options and both.k == 3
    assert dict(cumulative_variants(found))["skip_only"].options == DraftOptions()  # without it: the model itself
    assert "searched_papers_skip" not in dict(cumulative_variants(FULL, FULL.replace(options=DraftOptions())))
    with pytest.raises(ValueError, match="different models"):
        cumulative_variants(found, DraftSpec(SkipPlan(8, attn=(2,)), k=2))


def test_shorter_copies_are_a_lever_of_their_own(tmp_path):
    spec = FULL.replace(options=DraftOptions(weights="int4", group_size=128, head_tokens=16384, ngram=3, min_ngram=1,
                                             copy_tokens=10))
    assert DraftSpec.load(spec.save(tmp_path / "d.json")) == spec
    assert spec.key != FULL.replace(options=DraftOptions(weights="int4", group_size=128, ngram=3, copy_tokens=10)).key
    assert "3-gram copy (down to 1-gram) up to 10" in spec.describe()
    rows = dict(ablation_variants(spec))
    assert rows["without shorter copies"].options.min_ngram == 0 and rows["without shorter copies"].options.ngram == 3
    assert rows["without copy drafting"].options.ngram == 0 == rows["without copy drafting"].options.min_ngram
    assert dict(cumulative_variants(spec))["plus_cut_head"].options.min_ngram == 0


def test_a_copy_only_draft_is_ablated_against_the_model_draft(tmp_path):
    only = DraftSpec(SkipPlan(6), DraftOptions(ngram=2, min_ngram=1, copy_tokens=5, copy_candidates=3, tree_nodes=6,
                                               model_draft=False), k=1)
    assert DraftSpec.load(only.save(tmp_path / "d.json")) == only
    assert only.key != only.replace(options=DraftOptions(ngram=2, min_ngram=1, copy_tokens=5, copy_candidates=3,
                                                         tree_nodes=6)).key
    rows = dict(ablation_variants(only))
    assert "without copy drafting" not in rows  # that would be plain decoding
    assert rows["with model drafts"].options.model_draft
    assert not rows["a chain (no draft tree)"].options.model_draft
    cumulative = dict(cumulative_variants(only))
    assert cumulative["skip_only"].options == DraftOptions()  # the model's own draft, with nothing skipped
    assert not cumulative["plus_copy"].options.model_draft and not cumulative["plus_copy"].options.tree


def test_draft_options_own_the_copy_limit_the_longest_verify_and_the_group():
    from selfspec.draft.path import DraftOptions

    assert DraftOptions().copy_limit(5) == 5 and DraftOptions(ngram=3, copy_tokens=8).copy_limit(5) == 8
    assert DraftOptions().longest_verify(4) == 4  # no copying: the copy limit does not count
    assert DraftOptions(ngram=3, copy_tokens=8).longest_verify(4) == 8
    assert DraftOptions(ngram=3).longest_verify(4) == 4  # copies as long as k
    assert DraftOptions(ngram=3, copy_candidates=2, tree_nodes=12).longest_verify(4) == 12
    o = DraftOptions(weights="int4", group_size=64, head_weights="int8")
    assert (o.group_for(o.weights), o.group_for(o.head_weights), o.group_for("model")) == (64, 0, 0)
