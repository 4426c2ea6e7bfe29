"""Fused draft sublayers (selfspec.draft.fused): what they compute, where they run, and exact output through them."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft import fused
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.kernels import vnni
from tests.helpers import PROMPT

pytestmark = pytest.mark.skipif(not vnni.available(), reason=f"VNNI int4 kernel: {vnni.unavailable_reason()}")

OPTIONS = DraftOptions(weights="int4", group_size=128, head_weights="int4")


def _model(arch: str):
    return tiny_model(arch, dtype=torch.bfloat16, vocab_size=128, hidden_size=128, intermediate_size=256)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 3])
def test_fused_sublayers_compute_what_the_modules_compute(arch, rows):
    """The same draft copies through one call and through the modules: the same outputs and the same cache rows
    up to bf16 rounding (the module rounds between operators, the call in fp32), GQA, q/k/v biases (Qwen2) and
    several causal rows included."""
    model = _model(arch)
    path = DraftPath(model, SkipPlan(model.config.num_hidden_layers), OPTIONS)
    assert len(path.fused) == 2 * model.config.num_hidden_layers
    path.step = None  # the draft step through the modules, so that the hooks see each sublayer's inputs
    assert model.config.num_attention_heads > model.config.num_key_value_heads  # grouped heads
    layer = model.model.layers[1]
    seen = {}
    for name, sub in (("attn", layer.self_attn), ("mlp", layer.mlp)):
        sub.register_forward_hook(lambda m, a, kw, out, name=name: seen.setdefault(name, (a, kw)) and None,
                                  with_kwargs=True)  # a hook that returns something replaces the output
    ids = torch.tensor(PROMPT * 3)
    cache = PositionalKVCache(model, max_len=64)
    with torch.inference_mode():
        forward_at(model, cache, ids[:20], 0, keep=1)
        seen.clear()  # the draft forward's inputs, not the prefill's
        with path.drafting():
            forward_at(model, cache, ids[20:20 + rows], 20, keep=rows)
            args, kwargs = seen["attn"]
            kc, vc = cache.layers[1].keys, cache.layers[1].values
            slow = layer.self_attn.inner(*args, **kwargs)[0]
            slow_k, slow_v = kc[:, :, 20:20 + rows].clone(), vc[:, :, 20:20 + rows].clone()
            kc[:, :, 20:20 + rows] = 0  # the call writes them again
            vc[:, :, 20:20 + rows] = 0
            fast = layer.self_attn.fast(*args, **kwargs)[0]
            args, kwargs = seen["mlp"]
            mlp_slow, mlp_fast = layer.mlp.inner(*args, **kwargs), layer.mlp.fast(*args, **kwargs)
    # o_proj and down_proj round their inputs to int8 with one scale per block of 128 (vnni.ACT_BLOCK, here one
    # block a row): inputs that differ in their last bits round apart now and then, by a block's largest magnitude /
    # 127 each (1.3% measured here on AVX2; blocks of 64 gave 0.4%)
    tol = 2e-2
    assert fast.shape == slow.shape == (1, rows, model.config.hidden_size)
    assert _rel(fast, slow) < tol
    assert _rel(kc[:, :, 20:20 + rows], slow_k) < 1e-2 and torch.equal(vc[:, :, 20:20 + rows], slow_v)
    assert _rel(mlp_fast, mlp_slow) < tol


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_through_fused_sublayers_is_ar_output(arch):
    model = _model(arch)
    plan = SkipPlan(model.config.num_hidden_layers, attn=[1], mlp=[0])
    cfg = DecodeConfig(max_new_tokens=32, k=3, fallback=False)
    ar = autoregressive(model, PROMPT + PROMPT, cfg)
    path = DraftPath(model, plan, OPTIONS, stop_ids=(2,))
    assert len(path.fused) == 2 * model.config.num_hidden_layers - 2  # the kept sublayers
    assert path.step is not None  # draft steps run as one call per kept sublayer (FusedStep)
    sp = self_speculative(model, PROMPT + PROMPT, plan, cfg, draft=path)
    assert sp.tokens == ar.tokens and sp.stats.drafted > 0


def test_fused_calls_run_only_on_causal_draft_forwards_of_the_positional_cache():
    model = _model("qwen2")
    path = DraftPath(model, SkipPlan(model.config.num_hidden_layers), OPTIONS)
    attn = model.model.layers[0].self_attn
    h = torch.randn(1, 1, 128, dtype=torch.bfloat16)
    emb = model.model.rotary_emb(h, torch.tensor([[5]]))
    cache = PositionalKVCache(model, max_len=16)
    with torch.inference_mode(), path.drafting():
        cache.seek(5, 1)
        assert attn.fast(hidden_states=h, position_embeddings=emb, attention_mask=None, cache=cache) is not None
        cache.seek(5, 1, causal=False)  # a forward with its own mask (a tree's verify, the search's chunks)
        assert attn.fast(hidden_states=h, position_embeddings=emb, attention_mask=None, cache=cache) is None
        assert attn.fast(hidden_states=h, position_embeddings=emb, attention_mask=None, cache=None) is None
        cache.seek(5, 1)
        assert attn.fast(hidden_states=h.float(), position_embeddings=emb, attention_mask=None, cache=cache) is None
        assert model.model.layers[0].mlp.fast(h.float()) is None  # the operators take bf16 only
    assert attn.fast is None  # outside drafting the module runs


def test_fused_sublayers_apply_only_where_the_code_computes_them(monkeypatch):
    gemma = _model("gemma3")
    assert DraftPath(gemma, SkipPlan(gemma.config.num_hidden_layers), OPTIONS).fused == []
    qwen = _model("qwen2")
    plan = SkipPlan(qwen.config.num_hidden_layers)
    assert DraftPath(qwen, plan, DraftOptions(weights="int8")).fused == []  # int8 copies: the modules
    off = DraftOptions(weights="int4", group_size=128, fused=False)  # a run's variant that measures what it adds
    assert DraftPath(qwen, plan, off).fused == [] and off.record()["fused"] is False
    assert "fused" not in OPTIONS.record()  # the default, unrecorded: runs of before resume
    monkeypatch.setenv(fused.ENV, "0")
    assert DraftPath(_model("qwen2"), plan, OPTIONS).fused == []


def _base_calls(model) -> list:
    calls = []
    model.model.register_forward_hook(lambda *a: calls.append(1) and None)
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_fused_draft_step_computes_what_the_model_computes(arch, rows):
    """A whole draft step through FusedStep (a call per kept sublayer, its norm and residual add included, skipped
    sublayers left out) against the same draft through the model's modules with the fused sublayers: the same logits
    and the same cache rows up to bf16 rounding, and the model's own forward is not run."""
    model = _model(arch)
    plan = SkipPlan(model.config.num_hidden_layers, attn=[1], mlp=[0])
    path = DraftPath(model, plan, OPTIONS)
    step = path.step
    assert step is not None and len(step.blocks) == 2 * model.config.num_hidden_layers - 2
    ids = torch.tensor(PROMPT * 3)
    calls = _base_calls(model)
    got = {}
    with torch.inference_mode():
        for name, use in (("modules", None), ("step", step)):
            cache = PositionalKVCache(model, max_len=64)
            forward_at(model, cache, ids[:20], 0, keep=1)
            path.step = use
            calls.clear()
            with path.drafting():
                assert fused.draft_step(model) is use
                logits = forward_at(model, cache, ids[20:20 + rows], 20, keep=rows)
            assert fused.draft_step(model) is None  # switched off with the block
            got[name] = (logits, len(calls), [(lay.keys[:, :, :20 + rows].clone(), lay.values[:, :, :20 + rows].clone())
                                             for lay in cache.layers])
    (slow, slow_calls, slow_kv), (fast, fast_calls, fast_kv) = got["modules"], got["step"]
    assert slow_calls == 1 and fast_calls == 0
    assert fast.shape == slow.shape == (rows, model.config.vocab_size) and fast.dtype == slow.dtype
    assert _rel(fast, slow) < 2e-2
    for (k_slow, v_slow), (k_fast, v_fast) in zip(slow_kv, fast_kv):
        assert _rel(k_fast, k_slow) < 2e-2 and _rel(v_fast, v_slow) < 2e-2


def test_a_fused_draft_step_runs_only_where_it_computes_the_forward():
    qwen = _model("qwen2")
    plan = SkipPlan(qwen.config.num_hidden_layers)
    path = DraftPath(qwen, plan, OPTIONS)
    cache = PositionalKVCache(qwen, max_len=32)
    ids = torch.tensor(PROMPT)
    with torch.inference_mode(), path.drafting():
        cache.seek(4, 1, causal=False)  # a forward with its own mask (a tree's verify, the search's chunks)
        assert path.step(ids[:1], 4, cache, 1) is None
        cache.seek(4, 1)
        assert path.step(ids[:1], 5, cache, 1) is None  # positions that are not the slots the cache was sought to
        assert path.step(ids[:1], 4, None, 1) is None
        assert path.step(ids[:1], 4, cache, 1) is not None
    assert DraftPath(qwen, plan, DraftOptions(weights="int8")).step is None  # no fused sublayers
    assert DraftPath(qwen, plan, DraftOptions(weights="int4", group_size=128, fused=False)).step is None
    gemma = _model("gemma3")
    assert DraftPath(gemma, SkipPlan(gemma.config.num_hidden_layers), OPTIONS).step is None
