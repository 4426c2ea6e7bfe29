"""The search's report: why held-out prompts ran slower, where the time went, a cost model that priced rounds
too cheap."""

from selfspec import SkipPlan
from selfspec.draft.spec import DraftSpec


def test_the_report_says_why_held_out_prompts_ran_slower():
    from selfspec.search.report import SearchReport, format_report, heldout_gap

    def report(held: dict) -> SearchReport:
        cal = {"acceptance": 0.66, "tokens_per_round": 3.3, "decode_speedup": 1.72, "speedup": 1.6}
        return SearchReport(DraftSpec(SkipPlan(4), k=2), 1.7, {"predicted": cal, "measured": cal},
                            {"predicted": held, "measured": held}, 10, 1.0, "p.json", "cost model measured")

    low = report({"acceptance": 0.39, "tokens_per_round": 2.3, "decode_speedup": 1.37, "speedup": 1.36})
    line = heldout_gap(low)
    assert "1.37x against 1.72x" in line and "acceptance 0.39 against 0.66" in line and "agreed" in line
    assert line in format_report(low)
    same_acc = report({"acceptance": 0.65, "tokens_per_round": 2.0, "decode_speedup": 1.2, "speedup": 1.2})
    assert "about the same acceptance" in heldout_gap(same_acc)
    close = report({"acceptance": 0.6, "tokens_per_round": 3.0, "decode_speedup": 1.6, "speedup": 1.5})
    assert heldout_gap(close) is None and "note:" not in format_report(close)
    twins = [f"copy only, {n}-gram copy up to 5" for n in (3, 4, 8, 9)]
    close.candidates = [{"draft": "copy only, 2-gram copy up to 5", "predicted_speedup": 1.3, "measured_decode_speedup": 1.4,
                         "measured_speedup": 1.3, "twins": twins}]
    retimed = format_report(close).split("re-timed candidates:\n")[1].splitlines()
    assert retimed[1] == "    and 4 more with the same predicted rounds, not re-timed: " + "; ".join(twins[:3]) + "; ..."


def test_the_report_says_where_the_time_went_past_its_target():
    from selfspec.search.report import SearchReport, format_report, time_over

    plan = SkipPlan(4, provenance={"machine": {"cpu": "AMD EPYC", "isa": "AVX2", "cores": 2}})
    r = SearchReport(DraftSpec(plan, k=2), 1.7, {}, {}, 100, 698.0, "p.json", "cost model measured",
                     stages={"calibration and cost model": 137.0, "trials": 149.0, "re-timing": 87.0,
                             "held-out check": 185.0, "ablation": 140.0},
                     setup_seconds=109.0, time_target_s=600.0, plain_step_s=0.119)
    line = time_over(r)
    assert line.startswith("note: 807 s in all, over the 600 s target (search.time_target_s) by 207 s.")
    assert "(AMD EPYC, AVX2, 2 cores), where one full-model step of this model took 119 ms" in line
    assert "longest parts: held-out check 185 s, trials 149 s, ablation 140 s." in line
    assert line in format_report(r) and "; 109 s before it (prompts and model fetched" in format_report(r)
    assert line.endswith("Shorter, at the cost of what they measure: search.ablation=false (no ablation), "
                         "search.heldout.reps=1, search.retime.top_n=1, fewer search.n_trials.")
    del r.stages["ablation"]  # a search run with no ablation is not told to turn it off
    assert "search.ablation=false" not in time_over(r) and time_over(r).endswith(": search.heldout.reps=1, "
                                                                                 "search.retime.top_n=1, fewer search.n_trials.")
    for target in (None, 807.0):  # no target, or the run within it: no note
        r.time_target_s = target
        assert time_over(r) is None and "s target" not in format_report(r)


def test_the_report_says_when_the_cost_model_priced_the_rounds_too_cheap():
    from selfspec.search.report import SearchReport, format_report, prediction_gap

    def report(predicted, measured, acceptance=0.93, **overheads):
        return SearchReport(DraftSpec(SkipPlan(4), k=2), 3.0, {
            "predicted": {"acceptance": 0.92, "tokens_per_round": 4.4, "decode_speedup": predicted},
            "measured": {"acceptance": acceptance, "tokens_per_round": 4.5, "decode_speedup": measured,
                         "speedup": 2.0}}, {}, 100, 500.0, "p.json", "cost model measured",
            loop_overheads={"verify": -0.0226, "draft_step": -0.0028, **overheads})

    line = prediction_gap(report(3.21, 2.56))
    assert line.startswith("note: the chosen draft ran at 2.56x against 3.21x predicted on the same prompts and tokens, "
                           "with acceptance as predicted (0.93 / 0.92)")
    assert "(here -22.6 ms a verify, -2.8 ms a draft step)" in line and "--remeasure" in line
    assert line in format_report(report(3.21, 2.56))
    # a cost model with a verify overhead per weight format: the chosen draft's (model-precision weights here)
    assert "(here +5.0 ms a verify," in prediction_gap(report(3.21, 2.56, **{"verify/model": 0.005, "verify/int4-g32": 0.03}))
    assert prediction_gap(report(3.0, 2.6)) is None  # within 15%
    assert prediction_gap(report(3.21, 2.56, acceptance=0.80)) is None  # the rounds differ, not the prices
