"""The search space: copy-only drafts, the skip-free draft, round trips and fixed dimensions."""

import pytest

from selfspec import SelfSpecError, SkipPlan
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.search.space import DraftDims, SearchSpace


def test_a_copy_only_draft_in_the_space_is_one_draft_per_copy_setting():
    space = SearchSpace(6)
    only = DraftSpec(SkipPlan(6), DraftOptions(ngram=2, min_ngram=1, copy_tokens=5, copy_candidates=3, tree_nodes=6,
                                               model_draft=False), k=1)
    assert space.spec_of(space.params_of(only)) == only
    params = space.params_of(only)
    # whatever the trial drew for the model draft's dimensions, a copy-only draft has none of them
    noisy = {**params, "attn_2": 1, "mlp_3": 1, "weights": "int4", "head_tokens": 16384, "adaptive": True,
             "branch_below": 0.3, "k": 4}  # k too: the copies run to copy_tokens
    assert space.spec_of(noisy).key == only.key and not space.spec_of(noisy).plan.n_skipped
    assert space.spec_of({**params, "ngram": 0}).options.model_draft  # no copying: the model drafts
    up_to_k = space.spec_of({**params, "copy_tokens": 0, "k": 4})  # copies of up to k tokens: k matters
    assert up_to_k.k == 4 and space.spec_of(space.params_of(up_to_k)) == up_to_k
    assert "copy only" in only.describe() and only.options.record()["model_draft"] is False
    assert "model_draft" not in DraftOptions(ngram=2).record()
    with pytest.raises(SelfSpecError, match="needs copy drafting"):
        DraftOptions(model_draft=False)
    with pytest.raises(SelfSpecError, match="drop 0 from it"):  # else its ngram=0 trials draft with the model
        DraftDims(model_draft=(False,))
    assert DraftDims(model_draft=(False,), ngram=(2, 8)).model_draft == (False,)


def test_skipping_nothing_is_one_value_of_the_space_away():
    space = SearchSpace(6)
    bits = {f"{kind}_{i}": 1 for kind in ("attn", "mlp") for i in space.searchable}
    assert space.spec_of({**bits, "skipping": True}).plan.n_skipped == 8
    assert space.spec_of({**bits, "skipping": False}).plan.n_skipped == 0  # whatever the bits say
    free = DraftSpec(SkipPlan(6), DraftOptions(weights="int4", group_size=128, ngram=3), k=4)
    assert space.params_of(free)["skipping"] is False and space.spec_of(space.params_of(free)) == free
    skips = DraftSpec(SkipPlan(6, mlp=(3,)), DraftOptions(weights="int8"), k=2)
    assert space.params_of(skips)["skipping"] is True and space.spec_of(space.params_of(skips)) == skips
    always = SearchSpace(6, dims=DraftDims(skipping=(True,)))
    assert "skipping" not in always.params_of(free) and always.spec_of(always.params_of(free)) == free
    assert "skipping" not in always.describe()["dims"]  # studies made before the dimension still resume
    budget = SearchSpace(6, min_skipped=2)  # skipping nothing is outside this budget: not searched
    assert "skipping" not in budget.params_of(skips) and budget.spec_of({**bits}).plan.n_skipped == 8


def test_space_round_trip_and_fixed_dimensions():
    space = SearchSpace(6)
    spec = DraftSpec(SkipPlan(6, attn=(1, 4), mlp=(2,)), DraftOptions(weights="int4", group_size=128, head_tokens=16384,
                                                                       ngram=3, copy_tokens=10), k=4, adaptive=True,
                     threshold=0.4)
    assert space.spec_of(space.params_of(spec)) == spec
    fixed = SearchSpace(6, dims=DraftDims(weights=("model",), k=(2,), adaptive=(False,), ngram=(0,)))
    params = fixed.params_of(DraftSpec(SkipPlan(6, attn=(2,)), k=2))
    assert {"weights", "k", "adaptive", "ngram"}.isdisjoint(params)  # a fixed dimension is no Optuna parameter
    assert fixed.spec_of(params).options.weights == "model" and fixed.spec_of(params).k == 2
    with pytest.raises(SelfSpecError, match="outside the space"):
        fixed.params_of(DraftSpec(SkipPlan(6), k=5))
    older = SearchSpace(6, dims=DraftDims(min_ngram=(0,), model_draft=(True,), copy_per_match=(0,), head_weights=("model",)))
    # dimensions added later, held at their one old value, leave the description: older studies resume
    assert {"copy_fallback", "head_weights", "min_ngram", "model_draft", "copy_per_match"}.isdisjoint(
        older.describe()["dims"])
    assert {"min_ngram", "model_draft", "copy_per_match"} <= set(space.describe()["dims"])
    cut = DraftSpec(SkipPlan(6), DraftOptions(ngram=8, min_ngram=2, copy_tokens=10, copy_per_match=2,
                                              model_draft=False), k=1)
    assert space.spec_of(space.params_of(cut)) == cut and "2 per matched token" in cut.describe()
    uncut = space.spec_of({**space.params_of(cut), "copy_per_match": 0})
    assert uncut.key != cut.key  # a different draft, not a twin by construction
    assert space.spec_of({**space.params_of(cut), "ngram": 0}).options.copy_per_match == 0  # no copying, no cut
    heads = SearchSpace(6, dims=DraftDims(weights=("int8",), head_weights=("model", "int4"), group_size=(32, 128)))
    low = DraftSpec(SkipPlan(6), DraftOptions(weights="int8", head_tokens=16384, head_weights="int4", group_size=128,
                                              head_rescore=8))
    assert heads.spec_of(heads.params_of(low)) == low
    with pytest.raises(SelfSpecError, match="head_rescore=0 is outside the space"):  # the space rescores int4 heads
        heads.params_of(low.replace(options=DraftOptions(weights="int8", head_weights="int4", group_size=128)))
    assert [(o.head_weights, o.group_size, o.head_rescore) for o in heads.dims.head_formats()] == [
        ("int4", 32, 0), ("int4", 32, 8), ("int4", 128, 0), ("int4", 128, 8)]
    wide = SearchSpace(6, dims=DraftDims(ngram=(0, 1, 3), copy_fallback=(0, 1)))
    assert wide.describe()["dims"]["copy_fallback"] == [0, 1]
    tree = DraftSpec(SkipPlan(6, attn=(2,)), DraftOptions(ngram=3, copy_fallback=1), k=2)
    assert wide.spec_of(wide.params_of(tree)) == tree
    short = wide.spec_of({**wide.params_of(tree), "ngram": 1})  # a 1-gram draft has no shorter match to fall back to
    assert short.options.copy_fallback == 0 and not short.options.tree
    copies = SearchSpace(6, dims=DraftDims(ngram=(0, 1, 3), min_ngram=(0, 1), copy_fallback=(0, 1)))
    fall = DraftSpec(SkipPlan(6), DraftOptions(ngram=3, min_ngram=1, copy_tokens=10), k=2)
    assert copies.spec_of(copies.params_of(fall)) == fall
    assert "min_ngram" in copies.describe()["dims"]
    params = {**copies.params_of(fall), "copy_fallback": 1}  # no shorter match is left for a fallback tree
    assert copies.spec_of(params).options.copy_fallback == 0
    one = copies.spec_of({**params, "ngram": 1})
    assert one.options.min_ngram == 0  # a 1-gram draft has no shorter match


def test_growing_drafts_are_a_dimension_of_the_space():
    space = SearchSpace(6)
    assert "k_max" not in space.describe()["dims"]  # held at 0: studies made before the dimension resume
    grows = SearchSpace(6, dims=DraftDims(k=(2, 4), k_max=(0, 8)))
    spec = DraftSpec(SkipPlan(6), DraftOptions(weights="int4", group_size=128, ngram=3), k=4, k_max=8)
    assert grows.params_of(spec)["k_max"] == 8 and grows.spec_of(grows.params_of(spec)) == spec
    assert grows.spec_of({**grows.params_of(spec), "k_max": 0}).k_max == 0
    assert DraftDims(k_max=(0, 16)).longest_verify == 17  # a draft grown to 16 (past trees of 12), and the pending token
    only = DraftSpec(SkipPlan(6), DraftOptions(ngram=2, copy_tokens=5, model_draft=False), k=2)
    assert grows.spec_of({**grows.params_of(only), "k_max": 8}).k_max == 0  # copies only: nothing grows
    with pytest.raises(SelfSpecError, match="k_max values must be >= 0"):
        DraftDims(k_max=(-1,))


def test_a_fixed_exit_threshold_is_a_dimension_of_the_space():
    space = SearchSpace(6)
    assert space.describe()["dims"]["threshold_step"] == [0.05, 0.0]  # searched by default
    assert "threshold_step" not in SearchSpace(6, dims=DraftDims(threshold_step=(0.05,))).describe()["dims"]
    fixed = DraftSpec(SkipPlan(6), DraftOptions(weights="int4", group_size=128), k=4, adaptive=True, threshold=0.4,
                      threshold_step=0.0)
    assert space.params_of(fixed)["threshold_step"] == 0.0 and space.spec_of(space.params_of(fixed)) == fixed
    moving = space.spec_of({**space.params_of(fixed), "threshold_step": 0.05})
    assert moving.threshold_step == 0.05 and moving.key != fixed.key
    no_exit = space.spec_of({**space.params_of(fixed), "adaptive": False})  # no exit: the step is unused, one draft
    assert no_exit.threshold_step == 0.05 and no_exit == space.spec_of({**space.params_of(no_exit), "threshold_step": 0.0})
    with pytest.raises(SelfSpecError, match="threshold_step values"):
        DraftDims(threshold_step=(1.0,))
