"""The transformers methods of an evaluation: which kernels they run on, their sampling settings and seed, their
draft lengths."""

from dataclasses import replace

import pytest

from selfspec import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.eval.methods import build_method
from selfspec.kernels.packed import PackedLinear, kernels_label, packing_supported
from tests.helpers import PROMPT

needs_packing = pytest.mark.skipif(not packing_supported(), reason="this CPU's oneDNN cannot prepack bf16 weights "
                                   "(that needs AVX-512 bw/vl/dq or AVX-NE-CONVERT)")


@needs_packing
def test_transformers_methods_run_on_our_kernels_or_on_stock_ones_with_the_same_tokens():
    from selfspec.assets.models import load_model

    lm = load_model("tiny-llama", dtype="bfloat16")  # a byte tokenizer, so generate() has a pad/eos to use
    cfg = DecodeConfig(max_new_tokens=24)
    ours = build_method("autoregressive", lm, cfg)
    packed, stock = build_method("hf_generate", lm, cfg), build_method("hf_generate_stock", lm, cfg)
    lookup = build_method("hf_prompt_lookup", lm, cfg, options={"num_tokens": 4})
    assert (packed.name, packed.info["kernels"], stock.name, stock.info["kernels"]) == \
        ("hf_generate", kernels_label(True), "hf_generate_stock", "stock")  # this CPU's packing
    calls = []
    for linear in (m for m in lm.model.modules() if isinstance(m, PackedLinear)):
        linear.register_forward_hook(lambda mod, args, out: calls.append(mod.active))
    ids = PROMPT + PROMPT
    want = ours.generate(ids)
    for method, active in ((packed, True), (stock, False), (lookup, True)):
        calls.clear()
        got = method.generate(ids)
        assert got.tokens == want.tokens and got.stats.new_tokens == want.stats.new_tokens  # counted as ours
        assert calls and set(calls) == {active}  # which kernels ran


def test_transformers_methods_sample_with_the_runs_settings_and_seed():
    from selfspec.assets.models import load_model
    from selfspec.engine.sampling import SamplingParams

    # fp32: in bf16 this flat tiny model's logits can tie exactly, and top-p then keeps both tied tokens where top-k
    # and argmax keep one (hf_generate too, at position 10, on a Zen 3 once the decode attention ran in float32)
    lm = load_model("tiny-llama", dtype="float32")
    ids = PROMPT + PROMPT
    greedy = build_method("autoregressive", lm, DecodeConfig(max_new_tokens=24)).generate(ids).tokens
    hot = DecodeConfig(max_new_tokens=24, sampling=SamplingParams(temperature=1.5, top_p=0.95), seed=3)
    for name, options in (("hf_generate", None), ("hf_prompt_lookup", {"num_tokens": 4})):
        method = build_method(name, lm, hot, options=options)
        first, again = method.generate(ids), method.generate(ids)
        assert first.tokens == again.tokens  # seeded on each call
        assert first.stats.new_tokens == len(first.tokens) == 24
        assert first.tokens != greedy  # it samples: 24 tokens from a flat tiny model are not the argmax ones
        assert build_method(name, lm, replace(hot, seed=4), options=options).generate(ids).tokens != first.tokens
        for only_top in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)):
            top = build_method(name, lm, replace(hot, sampling=only_top), options=options).generate(ids)
            assert top.tokens == greedy  # the filters reach generate(): keeping one token is greedy


def test_assisted_and_early_exit_take_their_draft_length_for_each_call_only():
    from selfspec.assets.models import load_model

    # fp32: assisted decoding verifies several rows per forward, and on an AVX2 CPU bf16 runs on fp16 kernels whose
    # rounding differs by row count, so a near tie of this flat tiny model split it from AR (a Zen 3, 2026-11-25)
    lm = load_model("tiny-llama", dtype="float32")
    cfg = DecodeConfig(max_new_tokens=24)
    ids = PROMPT + PROMPT
    want = build_method("autoregressive", lm, cfg).generate(ids).tokens
    length = {"num_tokens": 3, "schedule": "heuristic_transient", "confidence": 0.0}
    config = lm.model.generation_config
    before = (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)
    seen = []
    hook = lm.model.register_forward_hook(lambda *_: seen.append(
        (config.num_assistant_tokens, config.num_assistant_tokens_schedule, config.assistant_confidence_threshold)))
    early = build_method("hf_early_exit", lm, cfg, options={"exit_layer": 2, **length})
    assert early.generate(ids).tokens == want
    hook.remove()
    assert set(seen) == {(3, "heuristic_transient", 0.0)}  # set while it ran ...
    assert (config.num_assistant_tokens, config.num_assistant_tokens_schedule,
            config.assistant_confidence_threshold) == before  # ... and put back
    assert {k: early.info[k] for k in length} == length and early.info["exit_layer"] == 2
    assisted = build_method("hf_assisted", lm, cfg, options={"assistant": "tiny-llama", **length})
    assert assisted.generate(ids).tokens == want and assisted.info["num_tokens"] == 3


@pytest.mark.parametrize("options, message", [({"schedule": "heuristic"}, "carries its draft length"),
                                              ({"num_tokens": 0}, "at least 1"),
                                              ({"confidence": 1.0}, r"in \[0, 1\)"),
                                              ({"exit_layer": 4}, r"exit_layer must be in 1\.\.3")])
def test_bad_draft_length_options_are_refused(options, message):
    from selfspec.assets.models import load_model

    lm = load_model("tiny-llama", dtype="bfloat16")
    with pytest.raises(SelfSpecError, match=message):
        build_method("hf_early_exit", lm, DecodeConfig(max_new_tokens=4), options=options)
