"""Prepacked bf16 weights: the same numbers and tokens as the stock linears, used only inside the block."""

from dataclasses import replace

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.draft import DraftOptions, DraftPath, LowPrecisionLinear
from selfspec.methods import build_method
from selfspec.models import LoadedModel
from selfspec.packed import PackedLinear, weight_packer
from selfspec.tiny import tiny_model
from tests.conftest import PROMPT

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")

PLAN = SkipPlan(4, attn=(1,), mlp=(2,))


def _bf16(arch="qwen2"):
    return tiny_model(arch, dtype=torch.bfloat16, vocab_size=96)  # fresh: packing wraps modules in place


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_packed_logits_are_bit_identical_and_only_inside_the_block(arch):
    model = _bf16(arch)
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(input_ids=x).logits
        packer = weight_packer(model)
        with packer.packed():
            assert all(lin.active for lin in packer.linears)
            inside = model(input_ids=x).logits
        after = model(input_ids=x).logits
    assert not any(lin.active for lin in packer.linears)
    n_linear = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert n_linear == len(packer.linears) > 4 * 4  # every projection of 4 layers, and the head
    assert packer.extra_bytes == sum(lin.weight.numel() * 2 for lin in packer.linears)
    assert torch.equal(before, after)
    assert torch.equal(before, inside)


def test_packed_blocks_nest_and_switch_off_on_error():
    packer = weight_packer(_bf16())
    with pytest.raises(ValueError):
        with packer.packed():
            with packer.packed():
                pass
            assert all(lin.active for lin in packer.linears)  # the inner block did not switch them off
            raise ValueError
    assert not any(lin.active for lin in packer.linears)


def test_autoregressive_tokens_do_not_depend_on_packing():
    model = _bf16()
    cfg = DecodeConfig(max_new_tokens=40)
    plain = autoregressive(model, PROMPT, replace(cfg, packed_weights=False))
    assert model.__dict__.get("_selfspec_packer") is None  # nothing packed when not asked for
    packed = autoregressive(model, PROMPT, cfg)
    assert packed.tokens == plain.tokens and len(packed.tokens) == 40
    assert weight_packer(model).linears


def test_fp32_weights_are_left_as_loaded():
    model = tiny_model("qwen2", vocab_size=96)
    packer = weight_packer(model)
    assert packer.linears == [] and packer.extra_bytes == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("pack_first", [True, False])
def test_draft_copies_wrap_the_packed_linears_in_either_order(pack_first):
    model = _bf16()
    if pack_first:
        weight_packer(model)
    path = DraftPath(model, PLAN, DraftOptions(weights="int8", head_tokens=40), stop_ids=(2,))
    packer = weight_packer(model)
    assert path.linears and all(isinstance(lin.inner, PackedLinear) for lin in path.linears)
    assert not any(isinstance(m.inner, LowPrecisionLinear) for m in packer.linears)
    x = torch.tensor([PROMPT])
    path.prepare(x)
    with torch.inference_mode():
        with path.drafting():
            draft_plain = model(input_ids=x).logits
        with packer.packed(), path.drafting():
            draft_packed = model(input_ids=x).logits  # the int8 copies win over the packed bf16 weights
    assert torch.equal(draft_plain, draft_packed)
    cfg = DecodeConfig(max_new_tokens=40, k=3, fallback=False)
    ar = autoregressive(model, PROMPT + PROMPT, cfg)
    sp = self_speculative(model, PROMPT + PROMPT, PLAN, cfg, draft=path)
    assert sp.tokens == ar.tokens


def test_methods_report_the_packed_copies_as_extra_memory():
    model = _bf16()
    lm = LoadedModel(name="tiny", model=model, tokenizer=None, eos_ids=frozenset({2}), source="tiny", info={})
    off = build_method("autoregressive", lm, DecodeConfig(max_new_tokens=4, packed_weights=False))
    assert off.extra_memory_bytes == 0
    on = build_method("autoregressive", lm, DecodeConfig(max_new_tokens=4))
    assert on.extra_memory_bytes == weight_packer(model).extra_bytes > 0
    spec = build_method("self_speculative", lm, DecodeConfig(max_new_tokens=4), PLAN, {"weights": "int8"})
    assert spec.extra_memory_bytes > on.extra_memory_bytes
