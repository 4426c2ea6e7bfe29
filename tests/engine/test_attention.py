"""The decode-sized attention: SDPA's results, switched per model instance, used by every method of a run."""

from dataclasses import replace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.engine import attention as attn
from selfspec.errors import SelfSpecError
from selfspec.eval.records import decode_record
from tests.helpers import PROMPT


class _Module(torch.nn.Module):  # what transformers' attention functions read from the layer
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def _inputs(heads, kv_heads, rows, keys, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, rows, 16, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(1, kv_heads, keys, 16, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(1, kv_heads, keys, 16, generator=g, dtype=torch.float64).to(dtype)
    return q, k, v


def _masks(rows, keys, dtype):
    pos = torch.arange(keys - rows, keys)[:, None]
    causal = torch.arange(keys)[None, :] <= pos
    window = causal & (torch.arange(keys)[None, :] > pos - 5)  # a sliding window
    additive = torch.zeros(rows, keys, dtype=dtype).masked_fill(~causal, torch.finfo(dtype).min)
    out = {"causal": causal[None, None], "window": window[None, None], "additive": additive[None, None]}
    if rows == 1:
        out["none"] = None
    return out


@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_results_are_sdpas(heads, kv_heads, rows):
    module = _Module(heads // kv_heads)
    for dtype, tol in ((torch.float64, 1e-12), (torch.bfloat16, 2e-2)):
        q, k, v = _inputs(heads, kv_heads, rows, 23, dtype)
        for name, mask in _masks(rows, 23, dtype).items():
            got, weights = attn.attention_forward(module, q, k, v, mask, scaling=0.3)
            want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
            assert weights is None and got.shape == want.shape == (1, rows, heads, 16) and got.dtype == dtype
            torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol, msg=f"{dtype} {name}")


def test_what_it_does_not_cover_is_sdpas_own():
    module = _Module(2)
    q, k, v = _inputs(4, 2, attn.MAX_ROWS + 1, 40, torch.float32)  # a prefill
    assert torch.equal(attn.attention_forward(module, q, k, v, None)[0], sdpa_attention_forward(module, q, k, v, None)[0])
    q, k, v = _inputs(4, 2, 3, 3, torch.float32)  # several rows with no mask: SDPA's causal rule
    assert torch.equal(attn.attention_forward(module, q, k, v, None)[0], sdpa_attention_forward(module, q, k, v, None)[0])


def test_switched_per_instance_inside_the_block():
    a, b = tiny_model("llama", vocab_size=96), tiny_model("qwen2", vocab_size=96)
    assert attn.implementation(a) == attn.implementation(b) == "sdpa"
    with attn.decode_attention(a):
        assert attn.implementation(a) == attn.NAME and attn.implementation(b) == "sdpa"
        with attn.decode_attention(a):  # nested: one
            pass
        assert attn.implementation(a) == attn.NAME
    assert attn.implementation(a) == "sdpa"
    with attn.decode_attention(a, on=False):
        assert attn.implementation(a) == "sdpa"
    a.set_attn_implementation("eager")  # another implementation is left alone
    with attn.decode_attention(a):
        assert attn.implementation(a) == "eager"
    a.set_attn_implementation("sdpa")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_decoding_attends_through_it_and_emits_the_same_tokens(arch):
    """fp64: the same tokens and logits as SDPA, for our AR and self-speculative decoding (Gemma3's sliding
    window included: 60 tokens run past it); and the layers did run it."""
    model = tiny_model(arch, dtype=torch.float64, vocab_size=96)
    seen = []
    layer = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    layer.register_forward_pre_hook(lambda mod, args: seen.append(attn.implementation(mod)))
    cfg = DecodeConfig(max_new_tokens=60, k=3, fallback=False)
    sdpa = autoregressive(model, PROMPT, replace(cfg, attention="sdpa"))
    assert set(seen) == {"sdpa"}
    seen.clear()
    ours = autoregressive(model, PROMPT, cfg)
    assert set(seen) == {attn.NAME} and ours.tokens == sdpa.tokens
    spec = self_speculative(model, PROMPT, SkipPlan(4, attn=(1,), mlp=(2,)), cfg)
    assert spec.tokens == sdpa.tokens
    assert attn.implementation(model) == "sdpa"  # as loaded once the block is left


def test_the_setting_is_checked_and_recorded():
    with pytest.raises(SelfSpecError, match="attention must be one of"):
        DecodeConfig(attention="flash")
    assert decode_record(DecodeConfig())["attention"] == "decode"
    assert "attention" not in decode_record(DecodeConfig(attention="sdpa"))  # as runs before it were recorded
