"""The search's settings: counts that must be positive, final stages fitted to the time target."""

import pytest

from selfspec import SelfSpecError, SkipPlan
from selfspec.draft.spec import DraftSpec
from selfspec.search.settings import HeldoutSettings, RetimeSettings, SearchSettings


@pytest.mark.parametrize("make, message", [
    (lambda: RetimeSettings(top_n=0), "retime.top_n must be an integer >= 1"),
    (lambda: RetimeSettings(reps=0), "retime.reps must be an integer >= 1"),
    (lambda: RetimeSettings(prompts=0), "retime.prompts must be an integer >= 1"),
    (lambda: HeldoutSettings(reps=0), "heldout.reps must be an integer >= 1"),
    (lambda: SearchSettings(cost_reps=0), "search.cost_reps must be an integer >= 1"),
    (lambda: SearchSettings(calibration_tokens=1), "search.calibration_tokens must be an integer >= 2"),
])
def test_search_settings_refuse_zero_counts(make, message):
    with pytest.raises(SelfSpecError, match=message):
        make()


def test_the_final_stages_lose_repetitions_only_where_that_meets_the_time_target():
    from selfspec.search.report import SearchReport, format_report
    from selfspec.search.settings import FinalStages, SearchSettings, fit_final_stages

    # by default the held-out check runs 2 reps of 4 prompts x 128 tokens, the ablation 2 reps on 4 prompts x 32
    # one 32-token run takes 2 s: the held-out check 2 x 2 x 4 x 8 = 128 s, the ablation (AR + 6 variants)
    # 2 x 7 x 4 x 2 = 112 s
    def fit(left, **settings):
        return fit_final_stages(SearchSettings(**settings), left, 2.0, 4, 4, 6, margin=1.0)

    assert fit(None) == FinalStages(2, 2)
    assert fit(240.0) == fit(1e9) == FinalStages(2, 2, estimate_s=240.0)
    assert fit(239.0) == fit(184.0) == FinalStages(2, 1, ("the ablation ran 1 repetition (not 2)",), 184.0)
    assert fit(183.9) == fit(120.0) == FinalStages(
        1, 1, ("the ablation ran 1 repetition (not 2)", "the held-out check ran 1 repetition (not 2)"), 120.0)
    assert fit(119.9) == fit(64.0) == FinalStages(1, 0, ("the ablation did not run",
                                                          "the held-out check ran 1 repetition (not 2)"), 64.0)
    assert fit(63.9) == fit(-50.0) == FinalStages(2, 2, estimate_s=240.0)  # nothing fits: as set, the note says why
    assert fit(100.0, fit_target=False) == FinalStages(2, 2, estimate_s=240.0)
    assert fit(100.0, ablation=False) == FinalStages(1, 0, ("the held-out check ran 1 repetition (not 2)",), 64.0)
    no_held = fit_final_stages(SearchSettings(), 60.0, 2.0, 0, 4, 6, margin=1.0)  # no held-out prompts
    assert no_held == FinalStages(2, 1, ("the ablation ran 1 repetition (not 2)",), 56.0)
    # the default margin: the estimate times 1.1 must fit
    assert fit_final_stages(SearchSettings(), 240.0, 2.0, 4, 4, 6).ablation_reps == 1
    assert fit_final_stages(SearchSettings(), 264.0, 2.0, 4, 4, 6).ablation_reps == 2

    r = SearchReport(DraftSpec(SkipPlan(4), k=2), 1.7, {}, {}, 100, 500.0, "p.json", "cost model measured",
                     time_target_s=600.0, trimmed=list(fit(150.0).trimmed))
    assert ("note: to finish within the 600 s target (search.time_target_s), the ablation ran 1 repetition (not 2), "
            "the held-out check ran 1 repetition (not 2); search.fit_target=false runs them as set.") in format_report(r)
    r.trimmed = []
    assert "fit_target" not in format_report(r)


def test_int4_groups_that_do_not_divide_the_models_inputs_leave_the_space():
    from selfspec.search.space import DraftDims, fitting_groups

    dims = DraftDims(group_size=(32, 128))
    assert fitting_groups(dims, 64).group_size == (32,)  # a tiny model's 64-wide inputs
    assert fitting_groups(dims, 1536) is dims
    assert fitting_groups(DraftDims(group_size=(128,)), 64).group_size == (128,)  # none would be left: the draft says


def test_frequent_cut_heads_leave_the_space_of_a_model_with_no_token_ranking():
    from selfspec.search.space import DraftDims, fitting_heads

    dims = DraftDims(head_tokens=(0, 16384), head_ids=("lowest", "frequent"))
    assert fitting_heads(dims, ranked=True) is dims
    assert fitting_heads(dims, ranked=False).head_ids == ("lowest",)
    assert fitting_heads(DraftDims(head_tokens=(16384,), head_ids=("frequent",)), False).head_ids == ("lowest",)
    no_cut = DraftDims(head_tokens=(0,), head_ids=("lowest", "frequent"))
    assert fitting_heads(no_cut, False) is no_cut  # no cut head searched: its base does not matter
