"""In-place sublayer skipping: identity on the residual, scoped to a with-block and one instance."""

import pytest
import torch

from selfspec import PlanError, SkipPlan, layer_skipper
from selfspec.assets.tiny import tiny_model
from selfspec.draft.skip import SkippableSublayer
from tests.helpers import PROMPT


def _logits(model):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([PROMPT])).logits


def test_skipped_layer_is_identity_on_the_residual_stream(model):
    with layer_skipper(model).skipping(SkipPlan.whole_layers(4, [2])), torch.inference_mode():
        hs = model(input_ids=torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(hs[3], hs[2], rtol=0, atol=0)  # layer 2 maps hs[2] -> hs[3]
    assert not torch.equal(hs[2], hs[1])


def test_skipping_is_scoped_and_restored(model):
    before = _logits(model)
    skipper = layer_skipper(model)
    with skipper.skipping(SkipPlan(4, mlp=(0,))):
        inside = _logits(model)
    assert not torch.allclose(before, inside)
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)
    with pytest.raises(ValueError), skipper.skipping(SkipPlan(4, attn=(0, 1))):
        raise ValueError("boom")
    assert not any(s.skip for s in skipper.attn + skipper.mlp)
    assert skipper.active is None
    torch.testing.assert_close(_logits(model), before, rtol=0, atol=0)


def test_state_belongs_to_one_instance():
    a, b = tiny_model("llama", seed=1), tiny_model("llama", seed=1)
    ref = _logits(b)
    with layer_skipper(a).skipping(SkipPlan(4, attn=(0, 1, 2))):
        torch.testing.assert_close(_logits(b), ref, rtol=0, atol=0)
    assert not isinstance(b.model.layers[0].self_attn, SkippableSublayer)  # b never wrapped


def test_wrapping_is_idempotent_and_removable():
    m = tiny_model("qwen2", seed=2)
    keys = set(m.state_dict())
    s1 = layer_skipper(m)
    assert layer_skipper(m) is s1
    assert isinstance(m.model.layers[0].mlp, SkippableSublayer)
    assert m.model.layers[0].self_attn.layer_idx == 0  # attributes pass through
    s1.remove()
    assert set(m.state_dict()) == keys


def test_plan_for_another_model_and_nesting_rejected(model):
    skipper = layer_skipper(model)
    with pytest.raises(PlanError, match="6-layer"):
        with skipper.skipping(SkipPlan(6, attn=(1,))):
            pass
    with skipper.skipping(SkipPlan(4, attn=(1,))):
        with pytest.raises(RuntimeError, match="nest"):
            with skipper.skipping(SkipPlan(4, mlp=(1,))):
                pass
