"""Each emitted token says where it came from."""

import pytest

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.decoding import SOURCES
from tests.helpers import PROMPT

PLAN = SkipPlan(4, attn=(1,), mlp=(2,))


@pytest.mark.parametrize("candidates", [1, 3])
def test_sources_follow_the_rounds(candidates):
    model = tiny_model("qwen2", vocab_size=96)
    prompt = PROMPT * 3
    cfg = DecodeConfig(max_new_tokens=48, k=3, fallback=False)
    opts = DraftOptions(ngram=1, copy_tokens=5, copy_candidates=candidates)
    sp = self_speculative(model, prompt, PLAN, cfg, draft=DraftPath(model, PLAN, opts))
    ar = autoregressive(model, prompt, cfg)
    assert len(sp.sources) == len(sp.tokens) and set(sp.sources) <= set(SOURCES)
    assert ar.sources == ["step"] * len(ar.tokens)
    assert sp.sources[0] == "step"  # the prefill's token
    # every round ends in the verify pass's own token (the last round's may be cut by max_new_tokens)
    assert sp.sources.count("verify") in (sp.stats.rounds, sp.stats.rounds - 1)
    accepted = sp.sources.count("copy") + sp.sources.count("draft")
    assert accepted <= sp.stats.accepted and sp.stats.accepted - accepted <= cfg.k + 2
    assert sp.stats.copy_rounds > 0
    if candidates == 1:  # on this model and prompt some copied tokens are accepted (checked once, deterministic)
        assert sp.sources.count("copy") > 0
