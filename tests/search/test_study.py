"""The plan search: deterministic objective, cost model, space, report, budget, warm starts, resume, workers."""

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace

import optuna
import pytest

from selfspec import DecodeConfig, SelfSpecError, SkipPlan, autoregressive
from selfspec.assets.tiny import TINY_VOCAB, tiny_model
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.search import workers
from selfspec.search.costs import COST_MODEL_VERSION, CostModel, SublayerCosts, formats_of, weight_format
from selfspec.search.rounds import RoundCounts
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import DraftDims, SearchSpace
from selfspec.search.study import (
    Evaluation,
    PredictedObjective,
    enqueue_warm_starts,
    finished,
    open_study,
    run_search,
    top_drafts,
)

PROMPTS = [[5, 9, 12, 40, 41, 7], [8, 8, 30, 2 + 4, 77, 100, 3]]
FORMATS = {"model": SublayerCosts(0.1, 0.1, 0.125), "int8": SublayerCosts(0.1, 0.05, 0.06),
           "int4-g32": SublayerCosts(0.1, 0.03, 0.035), "int4-g128": SublayerCosts(0.1, 0.028, 0.033)}
COSTS = CostModel(t_full=1.0, t_verify={m: 1.0 + 0.01 * m for m in range(2, 14)}, num_layers=4, draft=FORMATS,
                  head={16384: 0.05, 32768: 0.03},  # the default space searches int4 heads too
                  head_low={f"{n}/int4-g{g}{r}": 0.06 + n / 1e6 - (0.005 if r else 0) for n in (0, 16384, 32768)
                            for g in (32, 128) for r in ("", "+r8")})


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def simulator(tiny):
    conts = [autoregressive(tiny, p, DecodeConfig(max_new_tokens=12)).tokens for p in PROMPTS]
    return RoundSimulator(tiny, PROMPTS, conts)


def test_objective_is_deterministic_for_a_draft(tiny, simulator):
    spec = DraftSpec(SkipPlan(4, attn=(1,), mlp=(2,)), DraftOptions(ngram=2), k=3)
    obj = PredictedObjective(simulator, COSTS)
    a, b = obj(spec), obj(spec)
    conts = simulator.continuations
    fresh = PredictedObjective(RoundSimulator(tiny, PROMPTS, conts), COSTS)(spec)
    assert (a.value, a.acceptance) == (b.value, b.acceptance) == (fresh.value, fresh.acceptance)
    assert obj(DraftSpec(SkipPlan(4), k=3)).acceptance == 1.0  # fp32: the full model agrees with its own continuation


def test_retime_hands_back_the_full_models_continuations(tiny, simulator):
    from selfspec.search.retime import retime

    spec = DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(ngram=2), k=2)
    tokens: list[list[int]] = []
    (m,) = retime(tiny, PROMPTS, [spec], (), max_new_tokens=12, reps=2, ar_tokens=tokens)
    assert tokens == simulator.continuations  # AR's greedy tokens on each prompt, first repetition, in order
    assert m["decode_speedup"] > 0 and len(m["decode_speedup_range"]) == 2


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
    for target in (None, 807.0):  # no target, or the run within it: no note
        r.time_target_s = target
        assert time_over(r) is None and "s target" not in format_report(r)


def test_the_report_says_when_the_cost_model_priced_the_rounds_too_cheap():
    from selfspec.search.report import SearchReport, format_report, prediction_gap

    def report(predicted, measured, acceptance=0.93):
        return SearchReport(DraftSpec(SkipPlan(4), k=2), 3.0, {
            "predicted": {"acceptance": 0.92, "tokens_per_round": 4.4, "decode_speedup": predicted},
            "measured": {"acceptance": acceptance, "tokens_per_round": 4.5, "decode_speedup": measured,
                         "speedup": 2.0}}, {}, 100, 500.0, "p.json", "cost model measured",
            loop_overheads={"verify": -0.0226, "draft_step": -0.0028})

    line = prediction_gap(report(3.21, 2.56))
    assert line.startswith("note: the chosen draft ran at 2.56x against 3.21x predicted on the same prompts and tokens, "
                           "with acceptance as predicted (0.93 / 0.92)")
    assert "(here -22.6 ms a verify, -2.8 ms a draft step)" in line and "--remeasure" in line
    assert line in format_report(report(3.21, 2.56))
    assert prediction_gap(report(3.0, 2.6)) is None  # within 15%
    assert prediction_gap(report(3.21, 2.56, acceptance=0.80)) is None  # the rounds differ, not the prices


def test_predicted_time_formula():
    spec = DraftSpec(SkipPlan(4, attn=(1, 2), mlp=(1,)), DraftOptions(weights="int8", head_tokens=16384), k=3)
    counts = RoundCounts(tokens=20, plain_steps=1, model_rounds=Counter({3: 4, 1: 2}), copy_rounds=Counter({5: 1}),
                         drafted=19, accepted=12)
    step = 0.1 + (4 - 2) * 0.05 + (4 - 1) * 0.06 - 0.05
    want = 1 * 1.0 + 4 * (3 * step + 1.04) + 2 * (1 * step + 1.02) + 1 * 1.06
    assert COSTS.step_time(spec) == pytest.approx(step)
    assert COSTS.time(counts, spec) == pytest.approx(want)
    assert COSTS.predicted_speedup(counts, spec) == pytest.approx(20 * 1.0 / want)
    # the same seconds split as the loop clocks them (draft steps, verify passes, plain steps)
    parts = COSTS.breakdown(counts, spec)
    assert parts == pytest.approx({"draft": 14 * step, "verify": 4 * 1.04 + 2 * 1.02 + 1.06, "plain": 1.0})
    tree = RoundCounts(tokens=5, tree_rounds=Counter({(2, 6): 1, (0, 4): 1}), drafted=8, accepted=3)
    assert COSTS.breakdown(tree, spec) == pytest.approx({"draft": 2 * step, "verify": 1.07 + 1.05, "plain": 0.0})
    assert CostModel.from_dict(COSTS.to_dict()) == COSTS


def test_a_quantized_draft_head_is_priced_by_its_own_measurement():
    costs = CostModel.from_dict({**COSTS.to_dict(), "head_low": {"16384/int4-g128": 0.07, "0/int8": 0.02,
                                                                 "16384/int4-g128+r8": 0.065}})
    cut = DraftSpec(SkipPlan(4), DraftOptions(weights="int4", group_size=128, head_tokens=16384, head_weights="int4"),
                    k=3)
    base = 0.1 + 4 * 0.028 + 4 * 0.033
    assert costs.step_time(cut) == pytest.approx(base - 0.07)  # not the bf16 cut head's 0.05
    rescored = cut.replace(options=DraftOptions(weights="int4", group_size=128, head_tokens=16384,
                                                head_weights="int4", head_rescore=8))
    assert costs.step_time(rescored) == pytest.approx(base - 0.065)  # the head timed with its rescoring
    full = DraftSpec(SkipPlan(4), DraftOptions(weights="int8", head_weights="int8"), k=3)
    assert costs.step_time(full) == pytest.approx(0.1 + 4 * 0.05 + 4 * 0.06 - 0.02)
    assert CostModel.from_dict(costs.to_dict()) == costs
    older = {k: v for k, v in COSTS.to_dict().items() if k != "head_low"}  # studies made before quantized heads
    assert CostModel.from_dict(older) == replace(COSTS, head_low={})
    with pytest.raises(KeyError, match="no draft head 32768/int4-g128"):
        costs.step_time(cut.replace(options=DraftOptions(weights="int4", group_size=128, head_tokens=32768,
                                                         head_weights="int4")))


def test_the_cost_model_measures_quantized_heads_when_the_space_holds_them(tiny):
    from selfspec.provenance import machine_fingerprint
    from selfspec.search.calibration import costs_fit
    from selfspec.search.costs import measure_costs

    space = SearchSpace(4, dims=DraftDims(weights=("model",), head_tokens=(0, 40), head_weights=("model", "int4"),
                                          group_size=(32,), k=(3,), ngram=(0,), copy_candidates=(1,),
                                          branch_below=(0.0,)))
    costs = measure_costs(tiny, PROMPTS[0] * 3, space.dims.formats(), [0, 40], space.dims.longest_verify, reps=1,
                          machine=machine_fingerprint(), head_formats=space.dims.head_formats())
    # the space's default rescores a quantized head's top 8 ids (head_rescore): the head is timed with it, and
    # without it for the ablation
    assert set(costs.head_low) == {"0/int4-g32", "40/int4-g32", "0/int4-g32+r8", "40/int4-g32+r8"}
    assert set(costs.head) == {40}
    assert costs_fit({"costs": costs.to_dict()}, space)
    from selfspec.search.variants import ablation_variants

    for head_tokens in (0, 40):  # the report's ablation prices each lever's absence with this cost model
        found = space.spec_of({"head_weights": "int4", "head_tokens": head_tokens})
        assert found.options.head_rescore == 8
        for _, variant in ablation_variants(found):
            assert costs.step_time(variant) > 0
    assert costs_fit({"costs": costs.to_dict()}, SearchSpace(4, dims=replace(space.dims, head_rescore=(0,))))
    assert not costs_fit({"costs": costs.to_dict()}, SearchSpace(4, dims=replace(space.dims, head_rescore=(4,))))
    older = {k: v for k, v in costs.to_dict().items() if k != "head_low"}
    assert not costs_fit({"costs": older}, space)  # a cost model made before: measured again, not guessed
    assert costs_fit({"costs": older}, SearchSpace(4, dims=replace(space.dims, head_weights=("model",))))
    # the loop's overheads: one draft-step overhead for every format, the adaptive exit's softmax timed alone
    assert costs.version == COST_MODEL_VERSION and {"plain_step", "draft_step", "verify"} <= set(costs.overhead)
    assert 0 < costs.overhead["adaptive_step"] < costs.t_full
    assert not costs_fit({"costs": {**costs.to_dict(), "version": COST_MODEL_VERSION - 1}}, space)


def test_formats_of_a_cost_model_are_the_formats_its_keys_name():
    formats = [DraftOptions(), DraftOptions(weights="int8"), DraftOptions(weights="int4", group_size=32),
               DraftOptions(weights="int4", group_size=128)]
    costs = replace(COSTS, draft={weight_format(o): SublayerCosts(0.01, 0.001, 0.002) for o in formats})
    assert formats_of(costs) == formats


def test_loop_overheads_scale_each_repetition_by_the_ar_runs_around_it(tiny, monkeypatch):
    """Each repetition's draft runs are priced in units of the mean of the AR runs just before and after them, the
    drafts in rotating order, after a short warm-up: fake runs with known seconds give known overheads."""
    from types import SimpleNamespace

    from selfspec.search import costs as cm

    calls: list[str] = []
    ar_steps = iter([9.9, 0.10, 0.30, 0.20])  # warm-up, then before rep 0, between reps 0 and 1, after rep 1

    def fake_ar(model, prompt, cfg, stop_ids=()):
        calls.append(f"ar/{cfg.max_new_tokens}")
        return SimpleNamespace(stats=SimpleNamespace(step_time=next(ar_steps) * 4, plain_steps=4))

    def fake_spec(model, prompt, plan, cfg, stop_ids=(), draft=None):
        fmt = cm.weight_format(draft.options)
        calls.append(f"{fmt}/{cfg.max_new_tokens}")
        return SimpleNamespace(stats=SimpleNamespace(draft_time=0.05 * 6, drafted=6, verify_time=0.4, rounds=2))

    monkeypatch.setattr(cm, "autoregressive", fake_ar)
    monkeypatch.setattr(cm, "self_speculative", fake_spec)
    costs = replace(COSTS, t_full=0.2, t_verify={4: 0.25})
    formats = [DraftOptions(), DraftOptions(weights="int4", group_size=32)]
    out = cm.loop_overheads(tiny, PROMPTS[0], costs, formats, reps=2, tokens=24)
    assert calls == ["ar/4", "model/4", "int4-g32/4", "ar/24", "model/24", "int4-g32/24", "ar/24",
                     "int4-g32/24", "model/24", "ar/24"]
    # rep 0 in units of (0.10 + 0.30) / 2 = 0.2 s (scale 1), rep 1 of (0.30 + 0.20) / 2 = 0.25 s (scale 0.8)
    step = {f: costs.step_time(DraftSpec(SkipPlan(COSTS.num_layers), DraftOptions(weights=o.weights,
                                                                                 group_size=o.group_size), k=3))
            for f, o in (("model", formats[0]), ("int4", formats[1]))}
    draft = sorted(scale * 0.05 - step[f] for scale in (1.0, 0.8) for f in step)
    assert out["draft_step"] == pytest.approx((draft[1] + draft[2]) / 2)
    assert out["verify"] == pytest.approx((1.0 * 0.2 + 0.8 * 0.2) / 2 - 0.25)
    assert out["plain_step"] == 0.0 and out["adaptive_step"] > 0


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


def test_a_study_on_another_machine_is_rescored_from_its_round_counts(tmp_path, simulator):
    space = SearchSpace(4, dims=DraftDims(head_tokens=(0,), threshold=(0.4,), group_size=(32,)))
    study = open_study(tmp_path / "s.db", "m", "tiny", "random", 0)
    run_search(study, space, PredictedObjective(simulator, COSTS), n_trials=12)
    slow_verify = CostModel.from_dict({**COSTS.to_dict(), "t_verify": {str(m): 3.0 for m in range(2, 14)}})
    here = top_drafts(study, space, 12)
    there = top_drafts(study, space, 12, costs=slow_verify)
    assert {r.spec.key for r in here} == {d.key for r in there for d in (r.spec, *r.twins)}  # twins count once
    for r in there:
        counts = RoundCounts.from_dict(r.trial.user_attrs["counts"])
        assert r.value == pytest.approx(slow_verify.predicted_speedup(counts, r.spec))
        if counts.rounds:
            assert r.value < r.trial.value  # a dearer verify pass makes every draft that verifies slower
        else:  # a copy-only draft that never matched took plain steps only: no verify to price
            assert r.value == r.trial.value
    assert [r.value for r in there] == sorted((r.value for r in there), reverse=True)


def test_drafts_predicted_alike_are_re_timed_once(tmp_path):
    """Copy drafts whose n-gram sizes found the same matches are twins: one stands for them, the next
    places go to drafts that differ, and with no counts (the wall-clock objective) nothing is merged."""
    space = SearchSpace(4, dims=DraftDims(model_draft=(False,), ngram=(2, 3, 4, 8), copy_tokens=(5, 10), min_ngram=(0,)))
    study = open_study(tmp_path / "s.db", "twins", "tiny", "random", 0)

    def objective(spec):  # the counts depend on the copy length only: the n-gram sizes are twins
        long = spec.options.copy_tokens == 10
        counts = RoundCounts(tokens=40, plain_steps=4, copy_rounds=Counter({10 if long else 5: 6 if long else 8}),
                             drafted=60 if long else 40, accepted=30 if long else 28)
        return Evaluation(COSTS.predicted_speedup(counts, spec), counts.accepted / counts.drafted, 36 / counts.rounds, counts)

    drafts = [DraftSpec(SkipPlan(4), DraftOptions(ngram=n, copy_tokens=c, model_draft=False), k=1)
              for n in (2, 3, 4, 8) for c in (5, 10)]
    enqueue_warm_starts(study, space, drafts)
    run_search(study, space, objective, n_trials=8)
    assert {space.spec_of(t.params).key for t in study.trials} == {d.key for d in drafts}
    tops = top_drafts(study, space, 3, costs=COSTS)
    assert len(tops) == 2  # two behaviours: up to 5 or up to 10 tokens
    assert {r.spec.options.copy_tokens for r in tops} == {5, 10}
    for r in tops:
        assert len(r.twins) == 3
        assert {t.options.copy_tokens for t in r.twins} == {r.spec.options.copy_tokens}
        assert {t.options.ngram for t in r.twins} | {r.spec.options.ngram} == {2, 3, 4, 8}
    assert len(top_drafts(study, space, 3)) == 3  # without a cost model: distinct drafts only


def test_budget_enforced(tmp_path, simulator):
    space = SearchSpace(4, min_skipped=2, max_skipped=3, protect_first_last=False, dims=DraftDims(group_size=(32,)))
    study = open_study(tmp_path / "s.db", "b", "tiny", "random", 0)
    run_search(study, space, PredictedObjective(simulator, COSTS), n_trials=25)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert complete and all(2 <= t.user_attrs["n_skipped"] <= 3 for t in complete)
    assert finished(study) == 25


@pytest.mark.parametrize("kwargs", [dict(min_skipped=7, protect_first_last=True), dict(min_skipped=3, max_skipped=2)])
def test_budget_that_allows_no_plan(kwargs):
    with pytest.raises(SelfSpecError, match="allows no plan"):
        SearchSpace(4, **kwargs).check()


def test_enqueued_drafts_run_first(tmp_path, simulator):
    space = SearchSpace(4, dims=DraftDims(group_size=(32,)))
    warm = [DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(weights="int8"), k=2),
            DraftSpec(SkipPlan(4, mlp=(1, 2)), DraftOptions(ngram=2, copy_tokens=10), k=3)]
    study = open_study(tmp_path / "s.db", "w", "tiny", "tpe", 0)
    assert enqueue_warm_starts(study, space, warm) == 2
    run_search(study, space, PredictedObjective(simulator, COSTS), n_trials=4)
    trials = study.get_trials()
    assert [space.spec_of(t.params) for t in trials[:2]] == warm
    with pytest.raises(Exception, match="made for a 6-layer"):
        enqueue_warm_starts(open_study(tmp_path / "s2.db", "w2", "tiny", "tpe", 0), space, [DraftSpec(SkipPlan(6))])


def test_a_warm_start_written_before_head_rescoring_takes_the_spaces(capsys):
    from selfspec.search.study import in_head_rescoring, warm_start_params

    space = SearchSpace(4, dims=DraftDims(weights=("int4",), group_size=(32,), head_weights=("model", "int4")))
    older = DraftSpec(SkipPlan(4), DraftOptions(weights="int4", group_size=32, head_weights="int4", ngram=2), k=3)
    with pytest.raises(SelfSpecError, match="head_rescore=0 is outside the space"):  # as it is: refused
        warm_start_params(space, [older])
    (params,) = warm_start_params(space, [in_head_rescoring(space, older)])  # as the search reads it
    assert space.spec_of(params) == older.replace(options=DraftOptions(weights="int4", group_size=32,
                                                                       head_weights="int4", ngram=2, head_rescore=8))
    assert "head_rescore=0 is not in search.space.head_rescore=[8]; it starts with 8" in capsys.readouterr().err
    plain = DraftSpec(SkipPlan(4), DraftOptions(weights="int4", group_size=32), k=3)  # the model's head: as it is
    assert in_head_rescoring(space, plain) == plain and not capsys.readouterr().err
    both = SearchSpace(4, dims=replace(space.dims, head_rescore=(0, 8)))
    assert in_head_rescoring(both, older) == older  # a space that holds 0 keeps it


def test_anchors_are_generic_drafts_the_space_holds(tmp_path, simulator):
    """A new study runs the anchors first: the cheapest skip-free model draft with copies and a copy-only
    draft, each within the space; a space that cannot hold one (a skip budget, no copying, a pure
    layer-skip search) drops it rather than run a draft outside the space or one that saves nothing."""
    space = SearchSpace(6)
    free, copy = space.anchors()
    assert free.plan.n_skipped == 0 and free.options.weights == "int4" and free.options.model_draft
    assert free.options.ngram and free.options.head_weights == "int4"
    assert not copy.options.model_draft and copy.options.ngram
    for a in (free, copy):
        assert space.spec_of(space.params_of(a)) == a
    low = SearchSpace(6, dims=DraftDims(weights=("model", "int8"), head_weights=("model",)))
    assert low.anchors()[0].options.weights == "int8"  # the cheapest precision the space holds
    assert SearchSpace(6, min_skipped=2).anchors() == []  # skipping nothing (copy-only too) is outside the budget
    assert SearchSpace(6, dims=DraftDims(model_draft=(True,))).anchors() == [free]
    papers = SearchSpace(6, dims=DraftDims(weights=("model",), head_weights=("model",), ngram=(0,)))
    assert papers.anchors() == []  # a full-depth, full-precision draft that copies nothing saves nothing
    tiny = SearchSpace(4, dims=DraftDims(group_size=(32,)))
    study = open_study(tmp_path / "s.db", "a", "tiny", "tpe", 0)
    assert enqueue_warm_starts(study, tiny, tiny.anchors()) == 2
    run_search(study, tiny, PredictedObjective(simulator, COSTS), n_trials=3)
    assert [tiny.spec_of(t.params) for t in study.get_trials()[:2]] == tiny.anchors()


def test_interrupted_search_resumes_with_no_trial_lost(tmp_path, simulator):
    space = SearchSpace(4, dims=DraftDims(group_size=(32,)))
    obj = PredictedObjective(simulator, COSTS)
    study = open_study(tmp_path / "s.db", "r", "tiny", "tpe", 0)

    def stop_after_three(study, trial):
        if trial.number == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_search(study, space, obj, n_trials=10, callbacks=[stop_after_three])
    first = [(t.number, t.params) for t in study.get_trials()]
    assert len(first) == 3
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = study.ask()  # a trial left RUNNING by a worker on this host that was killed
    left.set_user_attr("worker", f"{socket.gethostname()}:{int(gone.stdout)}")
    study.ask()  # one asked by a worker killed before its heartbeat started: no worker recorded, none alive
    live = study.ask()  # and one of a live worker (this process): it is left alone
    live.set_user_attr("worker", workers.WORKER)
    resumed = open_study(tmp_path / "s.db", "r", "tiny", "tpe", 0)
    assert [t.number for t in resumed.get_trials(states=(optuna.trial.TrialState.RUNNING,))] == [live.number]
    resumed.tell(live, state=optuna.trial.TrialState.FAIL)
    run_search(resumed, space, obj, n_trials=10)
    assert finished(resumed) == 10
    assert [(t.number, t.params) for t in resumed.get_trials()][:3] == first


def test_study_reused_with_another_model(tmp_path):
    open_study(tmp_path / "s.db", "x", "model-a", "tpe", 0)
    with pytest.raises(SelfSpecError, match="made for model 'model-a'"):
        open_study(tmp_path / "s.db", "x", "model-b", "tpe", 0)


def test_storage_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SelfSpecError, match="cannot write the study storage"):
        open_study(blocker / "sub" / "s.db", "x", "m", "tpe", 0)


def test_unknown_sampler(tmp_path):
    with pytest.raises(SelfSpecError, match="unknown sampler"):
        open_study(tmp_path / "s.db", "x", "m", "nope", 0)


def test_an_unmarked_running_trial_lives_while_another_worker_does(tmp_path):
    """A trial asked but not yet marked by its worker counts as running only while another worker lives."""
    storage = workers.open_storage(tmp_path / "s.db")
    study = optuna.create_study(study_name="x", storage=storage)
    study.ask()
    assert workers.running_elsewhere(study) == 0  # no other worker: its asker is gone
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with workers.worker_slot(storage, "x"):
            optuna.load_study(study_name="x~worker-0", storage=storage).set_user_attr(
                "worker", f"{socket.gethostname()}:{sleeper.pid}")
            assert workers.running_elsewhere(study) == 1 and workers.fail_dead_trials(study) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    optuna.create_study(study_name="x~worker-0", storage=storage).set_user_attr(
        "worker", f"{socket.gethostname()}:{sleeper.pid}")  # a slot its killed holder never gave back
    assert workers.fail_dead_trials(study) == 1 and workers.running_elsewhere(study) == 0


def test_worker_slots_are_distinct_and_given_back(tmp_path):
    storage = workers.open_storage(tmp_path / "s.journal")
    with workers.worker_slot(storage, "x") as a, workers.worker_slot(storage, "x") as b:
        assert (a, b) == (0, 1)
    with workers.worker_slot(storage, "x") as c:
        assert c == 0


def test_a_claim_is_computed_once_and_a_dead_holder_is_taken_over(tmp_path):
    storage = workers.open_storage(tmp_path / "s.db")
    box = {}
    calls = []

    def compute():
        calls.append(1)
        box["v"] = 42
        return 42

    assert workers.claimed_once(storage, "x", "c", lambda: box.get("v"), compute) == 42
    assert workers.claimed_once(storage, "x", "c", lambda: box.get("v"), compute) == 42 and len(calls) == 1
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert workers.try_claim(storage, "x", "d")
    optuna.load_study(study_name="x~d", storage=storage).set_user_attr("worker", f"{socket.gethostname()}:{int(gone.stdout)}")
    assert workers.try_claim(storage, "x", "d")  # its holder is dead: taken over
    assert not workers.try_claim(storage, "x", "d")  # held by this live process


def test_storage_urls_and_bad_ones(tmp_path):
    url = f"sqlite:///{tmp_path}/u.db"
    study = open_study(url, "x", "m", "random", 0)
    assert study.study_name == "x" and (tmp_path / "u.db").is_file()
    with pytest.raises(SelfSpecError, match="cannot open the study storage nosuchdriver://"):
        workers.open_storage("nosuchdriver://host/db")


def test_ctrl_c_is_held_until_the_trial_is_told():
    from selfspec.search.study import ctrl_c_between_trials

    # as in a terminal; a test run started in the background (CI) ignores SIGINT: set it as Python does
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ctrl_c_between_trials() as check:
            check()  # nothing pending
            os.kill(os.getpid(), signal.SIGINT)  # held: no KeyboardInterrupt here ...
            time.sleep(0.05)
            with pytest.raises(KeyboardInterrupt):
                check()  # ... but at the next check
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: at once
                time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with ctrl_c_between_trials() as check:  # a process that ignores SIGINT keeps ignoring it
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer)
