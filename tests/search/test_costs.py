"""The search's cost model: the predicted time of a round, quantized heads, formats, loop overheads."""

from collections import Counter
from dataclasses import replace

import pytest

from selfspec import SkipPlan
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.search.costs import COST_MODEL_VERSION, CostModel, SublayerCosts, formats_of, weight_format
from selfspec.search.rounds import RoundCounts
from selfspec.search.space import DraftDims, SearchSpace
from tests.search.toy import COSTS, PROMPTS


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


def test_a_verify_is_priced_by_what_ran_before_it():
    """A verify after the model's draft steps takes the overhead measured after that weight format's steps, one
    after no draft step (copy rounds, copy trees) the model-precision one; older cost models pooled them."""
    spec = DraftSpec(SkipPlan(4, attn=(1, 2), mlp=(1,)), DraftOptions(weights="int8", head_tokens=16384), k=3)
    counts = RoundCounts(tokens=20, model_rounds=Counter({3: 4, 1: 2}), copy_rounds=Counter({5: 1}),
                         tree_rounds=Counter({(2, 6): 1, (0, 4): 1}), drafted=21, accepted=12)
    plain = COSTS.breakdown(counts, spec)["verify"]
    per_format = replace(COSTS, overhead={"verify": 0.5, "verify/int8": 0.02, "verify/model": 0.01})
    # 4 + 2 model rounds and one tree round after int8 draft steps, a copy round and a copy tree after none
    assert per_format.breakdown(counts, spec)["verify"] == pytest.approx(plain + 7 * 0.02 + 2 * 0.01)
    pooled = replace(COSTS, overhead={"verify": 0.03})
    assert pooled.breakdown(counts, spec)["verify"] == pytest.approx(plain + 9 * 0.03)


def test_a_rounds_first_draft_step_costs_first_later_ones():
    spec = DraftSpec(SkipPlan(4, attn=(1, 2), mlp=(1,)), DraftOptions(weights="int8", head_tokens=16384), k=3)
    costs = replace(COSTS, draft={**COSTS.draft, "int8": replace(COSTS.draft["int8"], first=1.5)})
    step = COSTS.step_time(spec)
    counts = RoundCounts(tokens=20, model_rounds=Counter({3: 4, 1: 2}), copy_rounds=Counter({5: 1}),
                         tree_rounds=Counter({(2, 6): 1, (0, 4): 1}), drafted=21, accepted=12)
    # 4 + 2 model rounds and one tree round drafted (the copy round and the copy tree did not): 7 first steps
    drafted = 3 * 4 + 2 + 2
    assert costs.breakdown(counts, spec)["draft"] == pytest.approx((drafted + 0.5 * 7) * step)
    assert costs.breakdown(counts, spec)["verify"] == pytest.approx(COSTS.breakdown(counts, spec)["verify"])
    assert costs.step_time(spec) == pytest.approx(step)  # a later step
    with_overhead = replace(costs, overhead={"draft_step": 0.01, "adaptive_step": 0.002})
    assert with_overhead.draft_time(spec, drafted, 7) == pytest.approx((drafted + 0.5 * 7) * step + drafted * 0.01)
    adaptive = spec.replace(adaptive=True)
    assert with_overhead.draft_time(adaptive, drafted, 7) == pytest.approx((drafted + 0.5 * 7) * step + drafted * 0.012)
    assert CostModel.from_dict(costs.to_dict()) == costs
    older = COSTS.to_dict()  # cost models before the first step was priced: every step alike
    older["draft"] = {k: {f: v for f, v in c.items() if f != "first"} for k, c in older["draft"].items()}
    assert CostModel.from_dict(older).draft["int8"].first == 1.0


def test_sublayer_costs_come_from_later_steps_and_the_first_step_from_one_after_a_plain_forward(tiny, monkeypatch):
    """On a fake clock where a draft forward costs twice as much when the forward before it was not the same
    draft (the caches hold other weights), the sublayer costs are those of the later steps and ``first`` is 2."""
    from contextlib import contextmanager

    from selfspec.search import costs as cm

    now, last = [0.0], [None]

    class FakeClock:
        def __init__(self, device=None):
            pass

        def now(self):
            return now[0]

    class FakePath:
        active = None

        def __init__(self, model, plan, options=None, stop_ids=()):
            self.model, self.plan = model, plan

        def prepare(self, tokens):
            pass

        @contextmanager
        def drafting(self):
            FakePath.active = self
            try:
                yield
            finally:
                FakePath.active = None

    def fake_forward(model, cache, tokens, pos, keep=1):
        path = FakePath.active
        if path is None:
            now[0] += 1.0 + 0.01 * len(tokens)
        else:
            n = path.plan.num_layers
            step = 0.1 + (n - len(path.plan.attn)) * 0.01 + (n - len(path.plan.mlp)) * 0.02
            now[0] += step * (1 if last[0] is path else 2)
        last[0] = path

    monkeypatch.setattr(cm, "Clock", FakeClock)
    monkeypatch.setattr(cm, "DraftPath", FakePath)
    monkeypatch.setattr(cm, "forward_at", fake_forward)
    monkeypatch.setattr(cm, "time_heads", lambda paths, hidden, reps, clock: {name: [0.0] for name in paths})
    monkeypatch.setattr(cm, "loop_overheads", lambda *a, **k: {})
    costs = cm.measure_costs(tiny, PROMPTS[0], [DraftOptions(), DraftOptions(weights="int4", group_size=32)], [0], 4,
                             reps=3)
    for fmt in ("model", "int4-g32"):
        c = costs.draft[fmt]
        assert (c.base, c.attn, c.mlp, c.first) == pytest.approx((0.1, 0.01, 0.02, 2.0))
    assert costs.t_full == pytest.approx(1.01) and costs.t_verify[4] == pytest.approx(1.04)


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
        verify = 0.4 if fmt == "model" else 0.5  # a verify after int4 draft steps costs more
        return SimpleNamespace(stats=SimpleNamespace(draft_time=0.05 * 6, drafted=6, verify_time=verify, rounds=2))

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
    # a draft whose round's first step costs twice a later one: 2 rounds of 6 steps are 8 steps' worth
    twice = replace(costs, draft={f: replace(c, first=2.0) for f, c in costs.draft.items()})
    ar_steps = iter([9.9, 0.10, 0.30, 0.20])
    out = cm.loop_overheads(tiny, PROMPTS[0], twice, formats, reps=2, tokens=24)
    draft = sorted((scale * 0.05 * 6 - 8 * step[f]) / 6 for scale in (1.0, 0.8) for f in step)
    assert out["draft_step"] == pytest.approx((draft[1] + draft[2]) / 2)
    # each format's verifies in units of the same AR runs, against the modelled 4-token verify (0.25 s)
    assert out["verify/model"] == pytest.approx((1.0 * 0.2 + 0.8 * 0.2) / 2 - 0.25)
    assert out["verify/int4-g32"] == pytest.approx((1.0 * 0.25 + 0.8 * 0.25) / 2 - 0.25)
    assert out["verify"] == pytest.approx((0.8 * 0.25 + 1.0 * 0.2) / 2 - 0.25)  # the median of all four, for reports
    assert out["plain_step"] == 0.0 and out["adaptive_step"] > 0
