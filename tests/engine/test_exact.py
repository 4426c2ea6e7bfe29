"""Padded rows and the exact-greedy mode: the same tokens, and in bf16 the same tokens as AR, always."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.errors import SelfSpecError
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


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_exact_mode_is_token_identical_in_bf16(make_model, arch, k):
    model = make_model(arch, torch.bfloat16)
    cfg = DecodeConfig(max_new_tokens=48, k=k, fallback=False, rows=k + 1, exact=True)
    ar = autoregressive(model, PROMPT, cfg).tokens
    assert len(ar) == 48
    for plan in PLANS:
        for opts in (DraftOptions(), DraftOptions(ngram=1, copy_tokens=k)):
            sp = self_speculative(model, PROMPT, plan, cfg, draft=DraftPath(model, plan, opts))
            assert sp.tokens == ar, (plan.describe(), opts)


def test_exact_mode_with_fallback_and_long_context(make_model):
    model = make_model("gemma3", torch.bfloat16)  # 100 tokens cross the sliding window of 8 many times
    cfg = DecodeConfig(max_new_tokens=100, k=4, rows=5, exact=True, fallback=True, fallback_min_rounds=2)
    ar = autoregressive(model, PROMPT, cfg).tokens
    bad = SkipPlan(N, attn=(0, 1, 2, 3), mlp=(0, 1, 2))
    sp = self_speculative(model, PROMPT, bad, cfg)
    assert sp.tokens == ar


def test_exact_mode_refuses_what_it_cannot_keep_exact(make_model):
    model = make_model("llama")
    with pytest.raises(SelfSpecError, match="set rows to the longest verify"):
        DecodeConfig(exact=True, rows=1)
    with pytest.raises(SelfSpecError, match=r"rows >= the longest verify \(7 tokens"):
        self_speculative(model, PROMPT, PLANS[0], DecodeConfig(k=4, rows=5, exact=True),
                         draft=DraftPath(model, PLANS[0], DraftOptions(ngram=1, copy_tokens=6)))
    with pytest.raises(SelfSpecError, match="draft trees"):
        self_speculative(model, PROMPT, PLANS[0], DecodeConfig(k=4, rows=5, exact=True),
                         draft=DraftPath(model, PLANS[0], DraftOptions(branch_below=0.5)))
    with pytest.raises(SelfSpecError, match="rows"):
        DecodeConfig(rows=0)
