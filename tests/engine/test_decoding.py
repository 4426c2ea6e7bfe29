"""Greedy self-speculative decoding is token-identical to greedy autoregressive decoding; bad arguments are one clear
error."""

import pytest
import torch

from selfspec import DecodeConfig, SelfSpecError, SkipPlan, autoregressive, self_speculative
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.sampling import SamplingParams
from selfspec.engine.speculate import DraftLength, Speculator
from tests.helpers import PROMPT

N = 4  # layers of the tiny models


def plans():
    return {
        "empty": SkipPlan(N),
        "one_layer": SkipPlan.whole_layers(N, [1]),
        "alternating": SkipPlan(N, attn=(0, 2), mlp=(1, 3)),
        "all_but_one": SkipPlan(N, attn=(0, 1, 2, 3), mlp=(0, 1, 2)),
    }


@pytest.mark.parametrize("plan_name", list(plans()))
@pytest.mark.parametrize("k", [1, 3, 8])
def test_greedy_speculative_equals_autoregressive(model, plan_name, k):
    cfg = DecodeConfig(max_new_tokens=40, k=k, fallback=False)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, plans()[plan_name], cfg)
    assert len(ar.tokens) == 40
    assert sp.tokens == ar.tokens
    s = sp.stats
    assert s.rounds > 0 and s.drafted >= s.accepted
    assert sum(s.accepted_per_position) == s.accepted
    assert sum(s.drafted_per_position) == s.drafted
    assert s.new_tokens == len(sp.tokens)


def test_empty_plan_accepts_everything(model):
    cfg = DecodeConfig(max_new_tokens=33, k=4, fallback=False)
    sp = self_speculative(model, PROMPT, SkipPlan(N), cfg)
    s = sp.stats.summary()
    assert s["acceptance_rate"] == 1.0
    # 1 token from prefill, then 8 rounds of 4 drafts + 1 = 40 > 32: the last round is cut to fit
    assert s["rounds"] == 7 and sp.stats.plain_steps == 0
    assert s["mean_accepted_length"] == pytest.approx(1 + sp.stats.accepted / sp.stats.rounds)


@pytest.mark.parametrize("k", [1, 4])
def test_adaptive_draft_length_is_exact(model, k):
    cfg = DecodeConfig(max_new_tokens=40, k=k, adaptive=True, threshold=0.3, fallback=False)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, SkipPlan.whole_layers(N, [2]), cfg)
    assert sp.tokens == ar.tokens


def test_adaptive_draft_stops_early_on_low_confidence(make_model):
    model = make_model("llama")
    # threshold near 1 stops every draft after its first token
    cfg = DecodeConfig(max_new_tokens=20, k=6, adaptive=True, threshold=0.99, threshold_step=0.0, fallback=False)
    sp = self_speculative(model, PROMPT, SkipPlan.whole_layers(N, [2]), cfg)
    assert sp.stats.drafted == sp.stats.rounds  # one draft per round


@pytest.mark.parametrize("max_new", [1, 2, 5, 7, 11])
def test_max_new_tokens_inside_a_round(model, max_new):
    cfg = DecodeConfig(max_new_tokens=max_new, k=4, fallback=False)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, SkipPlan(N), cfg)
    assert len(sp.tokens) == max_new
    assert sp.tokens == ar.tokens
    assert sp.stats.stop_reason == "max_new_tokens"


def test_zero_new_tokens(model):
    sp = self_speculative(model, PROMPT, SkipPlan(N), DecodeConfig(max_new_tokens=0))
    assert sp.tokens == [] and sp.stats.new_tokens == 0


def test_eos_inside_accepted_draft(model):
    cfg = DecodeConfig(max_new_tokens=30, k=8, fallback=False)
    reference = autoregressive(model, PROMPT, cfg).tokens
    # pick as EOS a token whose first occurrence is inside the first round (positions 1..8)
    idx = next(i for i in range(1, 9) if reference[i] not in reference[:i])
    eos = reference[idx]
    sp = self_speculative(model, PROMPT, SkipPlan(N), cfg, eos_ids={eos})
    ar = autoregressive(model, PROMPT, cfg, eos_ids={eos})
    assert sp.tokens == ar.tokens == reference[: idx + 1]
    assert sp.stats.stop_reason == "eos" and sp.stats.rounds == 1


def test_eos_as_first_token(model):
    first = autoregressive(model, PROMPT, DecodeConfig(max_new_tokens=1)).tokens[0]
    sp = self_speculative(model, PROMPT, SkipPlan(N), DecodeConfig(max_new_tokens=10), eos_ids={first})
    assert sp.tokens == [first] and sp.stats.stop_reason == "eos"


def test_autoregressive_matches_transformers_generate(model):
    """Our cache and loop against transformers' own greedy generate (its DynamicCache)."""
    ours = autoregressive(model, PROMPT, DecodeConfig(max_new_tokens=30)).tokens
    ref = model.generate(
        torch.tensor([PROMPT]), max_new_tokens=30, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(PROMPT):].tolist()
    assert ours == ref


def test_fallback_to_plain_decoding_when_drafts_fail(make_model):
    model = make_model("qwen2")
    bad_plan = SkipPlan(N, attn=(0, 1, 2, 3), mlp=(1, 2, 3))  # drafts almost never agree
    cfg = DecodeConfig(max_new_tokens=40, k=4, fallback=True, fallback_min_rounds=3)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, bad_plan, cfg)
    assert sp.tokens == ar.tokens
    assert sp.stats.fell_back_at is not None
    assert sp.stats.plain_steps > 0
    assert sp.stats.summary()["fell_back_at"] == sp.stats.fell_back_at


def test_the_gate_takes_plain_steps_for_a_draft_that_does_not_pay_and_keeps_probing(make_model):
    model = make_model("qwen2")
    bad_plan = SkipPlan(N, attn=(0, 1, 2, 3), mlp=(1, 2, 3))  # drafts almost never agree: a round of 4 draft
    # steps and a verify yields about one token, where a plain step yields one for about the verify's cost
    cfg = DecodeConfig(max_new_tokens=60, k=4, fallback=False, gate=True, fallback_min_rounds=2, gate_probe=3)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, bad_plan, cfg)
    assert sp.tokens == ar.tokens
    s = sp.stats
    assert s.gated_steps > 0 and s.plain_steps >= s.gated_steps and s.fell_back_at is None
    assert s.rounds > 2 + s.gated_steps // 3 - 1  # a probe round after every 3 gated steps
    assert s.summary()["gated_steps"] == s.gated_steps
    off = self_speculative(model, PROMPT, bad_plan, DecodeConfig(max_new_tokens=60, k=4, fallback=False))
    assert off.tokens == ar.tokens and off.stats.gated_steps == 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_closed_gate_still_runs_every_copy_round(make_model, monkeypatch, tree):
    model = make_model("llama")
    prompt = PROMPT + PROMPT[:6] + PROMPT  # repeats: copy rounds
    plan = SkipPlan(N, attn=(1,))
    opts = DraftOptions(ngram=2, copy_tokens=6, copy_candidates=3 if tree else 1, tree_nodes=8)
    cfg = DecodeConfig(max_new_tokens=40, k=3, fallback=False)
    want = autoregressive(model, prompt, cfg).tokens
    copies = self_speculative(model, prompt, plan, cfg, draft=DraftPath(model, plan, opts)).stats.copy_rounds
    monkeypatch.setattr(Speculator, "model_draft_pays", lambda self: False)
    got = self_speculative(model, prompt, plan, DecodeConfig(max_new_tokens=40, k=3, fallback=False, gate=True),
                           draft=DraftPath(model, plan, opts))
    s = got.stats
    assert got.tokens == want
    assert copies > 0 and s.copy_rounds > 0 and s.rounds == s.copy_rounds  # no model round ran
    assert s.gated_steps > 0 and s.gated_steps + 1 >= s.plain_steps


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampling"])
def test_a_copy_only_draft_never_drafts_with_the_model(make_model, monkeypatch, tree, temperature):
    model = make_model("qwen2")
    prompt = PROMPT + PROMPT[:6] + PROMPT  # repeats: copy rounds, and stretches with no match
    plan = SkipPlan(N)
    opts = DraftOptions(ngram=2, min_ngram=1, copy_tokens=5, copy_candidates=3 if tree else 1, tree_nodes=6,
                        model_draft=False)
    cfg = DecodeConfig(max_new_tokens=40, k=1, fallback=False, sampling=SamplingParams(temperature=temperature))
    monkeypatch.setattr(Speculator, "draft", lambda *a: pytest.fail("a copy-only draft ran the model's draft"))
    got = self_speculative(model, prompt, plan, cfg, draft=DraftPath(model, plan, opts))
    s = got.stats
    assert len(got.tokens) == 40 and s.rounds == s.copy_rounds > 0
    assert s.gated_steps > 0 and s.plain_steps >= s.gated_steps  # a plain step where nothing matched
    if not temperature:
        assert got.tokens == autoregressive(model, prompt, cfg).tokens


def test_gate_settings_are_checked():
    with pytest.raises(Exception, match="gate_probe"):
        DecodeConfig(gate=True, gate_probe=0)


def test_float64_long_generation_crosses_sliding_window(make_model):
    model = make_model("gemma3", torch.float64)  # sliding window 8; 60 tokens reach far past it
    cfg = DecodeConfig(max_new_tokens=60, k=5, fallback=False)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, SkipPlan(N, attn=(1,), mlp=(2,)), cfg)
    assert sp.tokens == ar.tokens


def test_stats_summary_is_consistent(model):
    cfg = DecodeConfig(max_new_tokens=25, k=3, fallback=False)
    sp = self_speculative(model, PROMPT, SkipPlan.whole_layers(N, [3]), cfg)
    s = sp.stats.summary()
    assert s["new_tokens"] == 25
    assert s["acceptance_rate"] == pytest.approx(sp.stats.accepted / sp.stats.drafted)
    assert s["total_time_s"] >= s["ttft_s"] > 0
    assert s["draft_time_s"] > 0 and s["verify_time_s"] > 0
    assert len(sp.stats.token_latencies) == 24  # every token after the first


def test_decode_argument_errors(model):
    with pytest.raises(SelfSpecError, match="k .* >= 1"):
        DecodeConfig(k=0)
    with pytest.raises(SelfSpecError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=-1)
    with pytest.raises(SelfSpecError, match="prompt is empty"):
        autoregressive(model, [], DecodeConfig())
    with pytest.raises(SelfSpecError, match="more than the model's context of 512"):
        self_speculative(model, list(range(3, 90)) * 6, SkipPlan(4), DecodeConfig(max_new_tokens=10))


def test_growing_drafts_are_exact_and_grow(model):
    """With k_max, a model draft grows by one token after each round accepted whole (an all-kept draft is always
    right) up to k_max; the output stays AR's."""
    cfg = DecodeConfig(max_new_tokens=40, k=2, k_max=5, fallback=False)
    ar = autoregressive(model, PROMPT, cfg)
    sp = self_speculative(model, PROMPT, SkipPlan(N), cfg)
    assert sp.tokens == ar.tokens
    # rounds of 2, 3, 4, then 5 drafts (each + 1 token): 1 + 3 + 4 + 5 + 6 x 4 = 37, then the last is cut to fit
    assert len(sp.stats.drafted_per_position) == 5
    assert sp.stats.drafted_per_position[:2] == [sp.stats.rounds] * 2
    lossy = self_speculative(model, PROMPT, SkipPlan.whole_layers(N, [1, 2]), cfg)
    assert lossy.tokens == ar.tokens


def test_draft_length_rule():
    length = DraftLength(DecodeConfig(k=3, k_max=5))
    seen = []
    for drafted, accepted in [(3, 3), (4, 4), (5, 5), (5, 5), (5, 2), (3, 3), (2, 2)]:
        seen.append(length.value)
        length.update(drafted, accepted)
    # grows after whole rounds up to 5; back to 3 after a miss; a short round (cut by room) resets too
    assert seen == [3, 4, 5, 5, 5, 3, 4] and length.value == 3
    fixed = DraftLength(DecodeConfig(k=3, k_max=3))
    fixed.update(3, 3)
    assert fixed.value == 3
    assert [DecodeConfig(k=3, k_max=m).longest_draft for m in (0, 2, 3, 5)] == [3, 3, 3, 5]
    with pytest.raises(SelfSpecError, match="k_max"):
        DecodeConfig(k=3, k_max=-1)
