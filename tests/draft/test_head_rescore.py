"""A quantized draft head's top ids rescored on the model's rows: the rescored logits are the model head's, the draft
keeps greedy output exact, and the option is keyed, searched, priced and ablated apart from the head without it."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from tests.helpers import PROMPT


def _head_logits(path: DraftPath, hidden: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(), path.drafting():
        return path.model.get_output_embeddings()(hidden)


@pytest.mark.parametrize("head_tokens", [0, 40])
def test_the_rescored_ids_take_the_model_heads_logits_and_the_others_keep_the_quantized_ones(head_tokens):
    model = tiny_model("qwen2", vocab_size=96)
    plan = SkipPlan(4)
    low = DraftPath(model, plan, DraftOptions(head_tokens=head_tokens, head_weights="int4", group_size=32))
    rescored = DraftPath(model, plan, DraftOptions(head_tokens=head_tokens, head_weights="int4", group_size=32,
                                                   head_rescore=5))
    torch.manual_seed(0)
    hidden = torch.randn(3, 2, model.config.hidden_size, dtype=next(model.parameters()).dtype)
    before, after = _head_logits(low, hidden), _head_logits(rescored, hidden)
    exact = torch.nn.functional.linear(hidden, model.get_output_embeddings().inner.weight)
    top = before.topk(5, dim=-1).indices
    changed = (after != before).reshape(-1, before.shape[-1])
    assert changed.sum(-1).max() <= 5  # only the top ids of each row move
    assert torch.allclose(after.gather(-1, top).float(), exact.gather(-1, top).float(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(before.gather(-1, top).float(), exact.gather(-1, top).float(), rtol=1e-2, atol=1e-2)
    rest = torch.ones_like(before, dtype=torch.bool).scatter(-1, top, False)
    assert torch.equal(after[rest], before[rest])
    if head_tokens:  # ids outside the cut head stay out of it
        assert torch.isinf(after[..., head_tokens:]).all() and torch.isfinite(after[..., :head_tokens]).all()


def test_a_rescored_draft_stays_exact_and_is_keyed_apart():
    from selfspec.search.rounds import forward_key

    model = tiny_model("qwen2", vocab_size=96)
    plan, prompt = SkipPlan(4, attn=(1,)), PROMPT + PROMPT
    cfg = DecodeConfig(max_new_tokens=32, k=3, fallback=False)
    ar = autoregressive(model, prompt, cfg).tokens
    opts = {r: DraftOptions(weights="int4", group_size=32, head_weights="int4", head_rescore=r) for r in (0, 4)}
    paths = {r: DraftPath(model, plan, o, stop_ids=(2,)) for r, o in opts.items()}
    for r in (4, 0, 4):
        assert self_speculative(model, prompt, plan, cfg, draft=paths[r]).tokens == ar
    spec = DraftSpec(plan, opts[4], k=3)
    assert DraftSpec.from_dict(spec.to_dict()).options.head_rescore == 4 and "top 4 rescored" in spec.describe()
    plain = DraftSpec(plan, opts[0], k=3)
    assert spec.key != plain.key and forward_key(spec) != forward_key(plain)
    assert "head_rescore" not in opts[0].record() and opts[4].record()["head_rescore"] == 4
    with pytest.raises(SelfSpecError, match="head_rescore"):
        DraftOptions(head_rescore=4)  # the model's head: nothing to rescore
    with pytest.raises(SelfSpecError, match="head_rescore"):
        DraftOptions(head_weights="int4", head_rescore=-1)


def test_the_search_fixes_rescoring_for_quantized_heads_prices_it_and_ablates_it():
    from selfspec.search.costs import head_format
    from selfspec.search.space import DraftDims, SearchSpace
    from selfspec.search.variants import ablation_variants

    space = SearchSpace(4, dims=DraftDims(weights=("int4",), group_size=(32,), head_weights=("model", "int4")))
    params = {"head_weights": "int4"}
    spec = space.spec_of(params)
    assert spec.options.head_rescore == 8  # the default: one value, not a searched dimension
    assert space.spec_of({"head_weights": "model"}).options.head_rescore == 0  # the model's head: none
    assert "head_rescore" not in space.params_of(spec) and space.spec_of(space.params_of(spec)) == spec
    assert space.describe()["dims"]["head_rescore"] == [8]
    assert "head_rescore" not in SearchSpace(4, dims=DraftDims(head_rescore=(0,))).describe()["dims"]
    both = SearchSpace(4, dims=DraftDims(head_weights=("int4",), group_size=(32,), head_rescore=(0, 8)))
    assert both.params_of(spec)["head_rescore"] == 8
    assert {head_format(o) for o in both.dims.head_formats()} == {"0/int4-g32", "0/int4-g32+r8"}
    labels = dict(ablation_variants(spec))
    assert labels["without head rescoring"].options.head_rescore == 0
    assert labels["without the quantized head"].options == DraftOptions(weights="int4", group_size=32)
    with pytest.raises(SelfSpecError, match="head_rescore"):
        DraftDims(head_rescore=(-1,))
