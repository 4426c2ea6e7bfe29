"""Padded rows give the same tokens; row-invariant forwards give AR's tokens in bf16 over long runs too."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.errors import SelfSpecError
from selfspec.kernels import vnni
from tests.helpers import PROMPT

N = 4
PLANS = [SkipPlan(N, attn=(1,), mlp=(2,)), SkipPlan(N, attn=(0, 2), mlp=(1, 3)), SkipPlan.whole_layers(N, [3])]


@pytest.mark.parametrize("rows", [2, 5])
def test_padded_rows_give_the_same_logits_in_fp64(make_model, rows):
    model = make_model("gemma3", torch.float64)
    ids = torch.tensor(PROMPT)
    out = {}
    for r in (1, rows):
        cache = PositionalKVCache(model, max_len=len(PROMPT) + 8)
        forward_at(model, cache, ids[:-3], 0, keep=1)
        out[r] = torch.cat([forward_at(model, cache, ids[-3:-2], len(PROMPT) - 3, keep=1, rows=r),
                            forward_at(model, cache, ids[-2:], len(PROMPT) - 2, keep=2, rows=r)])
    torch.testing.assert_close(out[1], out[rows], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rows", [1, 3, 6])
def test_padded_rows_keep_greedy_output(model, rows):
    ref = autoregressive(model, PROMPT, DecodeConfig(max_new_tokens=30, rows=1)).tokens
    cfg = DecodeConfig(max_new_tokens=30, k=4, fallback=False, rows=rows)
    assert autoregressive(model, PROMPT, cfg).tokens == ref
    plan = PLANS[0]
    path = DraftPath(model, plan, DraftOptions(ngram=2))
    assert self_speculative(model, PROMPT, plan, cfg, draft=path).tokens == ref


@pytest.mark.parametrize("k", [1, 3, 5])
def test_wide_verifies_are_token_identical_in_bf16(make_model, k):
    """Verifies as wide as the longest (copies of k+2 tokens) and AR steps of one row where rows is 1."""
    model = make_model("qwen2", torch.bfloat16)
    for rows in (2, 6):
        cfg = DecodeConfig(max_new_tokens=48, k=k, fallback=False, rows=rows)
        ar = autoregressive(model, PROMPT, cfg).tokens
        assert len(ar) == 48
        for plan in PLANS:
            for opts in (DraftOptions(), DraftOptions(ngram=1, copy_tokens=k + 2)):
                sp = self_speculative(model, PROMPT, plan, cfg, draft=DraftPath(model, plan, opts))
                assert sp.tokens == ar, (rows, plan.describe(), opts)


@pytest.mark.skipif(not vnni.available(), reason="no C++ row kernel here")
def test_padding_rows_attend_one_key_on_the_row_kernel(make_model, monkeypatch):
    """A padded step's real rows compute what an unpadded step computes, bit for bit in bf16, while its padding
    rows attend their first key only (their cost does not grow with the context)."""
    model = make_model("qwen2", torch.bfloat16)
    counts = []
    kernel = vnni.row_attention

    def spy(q, k, v, count, index, scale):
        counts.append(count.tolist())
        return kernel(q, k, v, count, index, scale)

    monkeypatch.setattr(vnni, "row_attention", spy)
    ids, n = torch.tensor(PROMPT), len(PROMPT)
    out = {}
    with torch.inference_mode(), decode_attention(model):
        for rows in (1, 6):
            cache = PositionalKVCache(model, max_len=n + 8)
            forward_at(model, cache, ids[:-3], 0, keep=1)
            counts.clear()
            out[rows] = torch.cat([forward_at(model, cache, ids[-3:-2], n - 3, keep=1, rows=rows),
                                   forward_at(model, cache, ids[-2:], n - 2, keep=2, rows=rows)])
            assert counts, "the row kernel did not serve the steps"
            one, two = counts[0], counts[-1]
            expect = ([n - 2], [n - 1, n]) if rows == 1 else ([n - 2] + [1] * 5, [n - 1, n] + [1] * 4)
            assert (one, two) == expect
    assert torch.equal(out[1], out[6])


def test_long_runs_across_a_sliding_window_with_fallback(make_model):
    model = make_model("gemma3", torch.bfloat16)  # 100 tokens cross the sliding window of 8 many times
    cfg = DecodeConfig(max_new_tokens=100, k=4, rows=5, fallback=True, fallback_min_rounds=2)
    ar = autoregressive(model, PROMPT, cfg).tokens
    bad = SkipPlan(N, attn=(0, 1, 2, 3), mlp=(0, 1, 2))
    sp = self_speculative(model, PROMPT, bad, cfg)
    assert sp.tokens == ar
    tree = DraftPath(model, PLANS[0], DraftOptions(ngram=1, copy_tokens=6, copy_candidates=3))
    assert self_speculative(model, PROMPT, PLANS[0], cfg, draft=tree).tokens == ar


def test_the_attention_that_is_not_row_invariant_still_decodes(make_model):
    """``row_invariant=false`` rounds by the forward's width; in fp32 it keeps AR's tokens on these rows."""
    model = make_model("llama")
    cfg = DecodeConfig(max_new_tokens=30, k=3, fallback=False, row_invariant=False)
    ar = autoregressive(model, PROMPT, cfg).tokens
    assert self_speculative(model, PROMPT, PLANS[0], cfg).tokens == ar


def test_rows_out_of_range_are_refused():
    with pytest.raises(SelfSpecError, match="rows"):
        DecodeConfig(rows=0)
