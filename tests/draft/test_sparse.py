"""A draft whose MLPs keep only their largest channels: the wrapper keeps each row's top fraction and nothing else,
only while drafting; the draft is a draft of its own to the simulator; greedy output stays the model's."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.sparse import TopChannels, top_channels
from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from tests.helpers import PROMPT


def test_top_channels_keeps_each_rows_largest_magnitudes_and_zeroes_the_rest():
    act = TopChannels(torch.nn.Identity())
    x = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -0.2, -1.0]])
    assert torch.equal(act(x), x)  # keep 1: the activation as it is
    act.keep = 0.5
    assert torch.equal(act(x), torch.tensor([[0.0, -3.0, 2.0, 0.0], [4.0, 0.0, 0.0, -1.0]]))
    act.keep = 0.01
    assert torch.count_nonzero(act(x), dim=-1).tolist() == [1, 1]  # at least one channel a row


def test_a_sparse_draft_changes_the_draft_only_inside_its_block_and_is_its_own_draft():
    from selfspec.search.rounds import forward_key

    model = tiny_model("qwen2", seed=5)
    n = model.config.num_hidden_layers
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(ids).logits
        path = DraftPath(model, SkipPlan(n, mlp=(1,)), DraftOptions(weights="int4", mlp_keep=0.25))
        assert len(path.channels) == n - 1 and all(a.keep == 1.0 for a in path.channels)  # the kept MLPs only
        with path.drafting():
            assert {a.keep for a in path.channels} == {0.25}
            sparse = model(ids).logits
        dense = DraftPath(model, SkipPlan(n, mlp=(1,)), DraftOptions(weights="int4"))
        with dense.drafting():
            drafted = model(ids).logits
        assert torch.equal(model(ids).logits, before)  # outside the block: the model as loaded
    assert not torch.allclose(sparse, drafted)
    specs = [DraftSpec(SkipPlan(n), DraftOptions(weights="int4", mlp_keep=f), k=3) for f in (1.0, 0.5)]
    assert forward_key(specs[0]) != forward_key(specs[1]) and specs[0].key != specs[1].key
    assert "top 50%" in specs[1].describe() and DraftSpec.from_dict(specs[1].to_dict()) == specs[1]
    assert "mlp_keep" not in specs[0].options.record() and specs[1].options.record()["mlp_keep"] == 0.5
    with pytest.raises(SelfSpecError, match="mlp_keep"):
        DraftOptions(mlp_keep=0.0)
    with pytest.raises(SelfSpecError, match="activation"):
        top_channels(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("weights", ["model", "int4"])
def test_greedy_output_with_a_sparse_draft_is_the_models(weights):
    model = tiny_model("llama", seed=7)
    cfg, plan = DecodeConfig(max_new_tokens=24, k=4), SkipPlan(model.config.num_hidden_layers)
    path = DraftPath(model, plan, DraftOptions(weights=weights, mlp_keep=0.3))
    assert self_speculative(model, PROMPT, plan, cfg, draft=path).tokens == autoregressive(model, PROMPT, cfg).tokens
