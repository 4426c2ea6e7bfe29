"""KV cache invariants: positions set by the loop, skipped layers write nothing, free rollback."""

import torch

from selfspec import DecodeConfig, SkipPlan, layer_skipper
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.cache import PositionalKVCache, cache_kwargs
from selfspec.engine.decoding import Request
from selfspec.engine.speculate import Speculator
from tests.helpers import PROMPT


def _full_cache_keys(model, tokens):
    """Keys of every layer after one full-depth forward over ``tokens`` in a fresh cache."""
    cache = PositionalKVCache(model, max_len=len(tokens))
    cache.seek(0, len(tokens))
    with torch.inference_mode():
        model(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None],
              **cache_kwargs(model, cache), use_cache=True)
    return [layer.keys.clone() for layer in cache.layers]


def test_skipped_attention_writes_nothing(model):
    cache = PositionalKVCache(model, max_len=32)
    plan = SkipPlan(4, attn=(1, 3))
    with torch.inference_mode(), layer_skipper(model).skipping(plan):
        cache.seek(0, 5)
        model(input_ids=torch.tensor([PROMPT[:5]]), position_ids=torch.arange(5)[None],
              **cache_kwargs(model, cache), use_cache=True)
    for i, layer in enumerate(cache.layers):
        written = bool(layer.keys[:, :, :5].abs().sum() > 0)
        assert written == (i not in plan.attn), f"layer {i}"
        assert layer.keys[:, :, 5:].abs().sum() == 0  # nothing past the window


def test_after_rounds_committed_slots_hold_full_model_values(make_model):
    model = make_model("llama", torch.float64)
    cfg = DecodeConfig(max_new_tokens=30, k=4, fallback=False)
    run = Request(model, PROMPT, cfg, (), "self_speculative", extra_slots=cfg.k + 1)
    spec = Speculator(run, DraftPath(model, SkipPlan(4, attn=(1,), mlp=(0, 2)), DraftOptions()))
    ptrs = [layer.keys.data_ptr() for layer in run.cache.layers]
    with torch.inference_mode():
        spec.start()
        for _ in range(4):
            spec.round()
    assert run.stats.drafted > run.stats.accepted  # some drafts were rejected and rolled back
    committed = PROMPT + run.out[:-1]  # the last emitted token is pending, not yet in the cache
    assert run.pos == len(committed)
    reference = _full_cache_keys(model, committed)
    for layer, ref in zip(run.cache.layers, reference):
        torch.testing.assert_close(layer.keys[:, :, : run.pos], ref, rtol=1e-9, atol=1e-9)
    # rollback never reallocated or copied the cache
    assert ptrs == [layer.keys.data_ptr() for layer in run.cache.layers]


def test_seek_bounds(model):
    cache = PositionalKVCache(model, max_len=8)
    cache.seek(6, 2)
    assert cache.get_seq_length() == 6 and cache.get_mask_sizes(2, 0) == (8, 0)
    import pytest

    from selfspec.errors import SelfSpecError

    with pytest.raises(SelfSpecError):
        cache.seek(7, 2)
