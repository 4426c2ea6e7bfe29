"""Tiny random causal LMs built in-process (no download), for tests and demos.

Each has the real architecture of its family (Llama, Qwen2 with q/k/v biases,
Gemma3 with sliding-window layers, extra norms and soft-capping) at a size
that runs a forward in about a millisecond on CPU. Weights are seeded, so a
given ``(arch, seed)`` always gives the same model.
"""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    Qwen2Config,
)

TINY_ARCHS = ("llama", "qwen2", "gemma3")


def tiny_config(arch: str, vocab_size: int = 96, num_layers: int = 4, max_positions: int = 512,
                tie_embeddings: bool = False, hidden_size: int = 64, intermediate_size: int = 128):
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=tie_embeddings,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "gemma3":
        # sliding window of 8 with a full layer every 2nd: tests reach past the window
        layer_types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
        return Gemma3TextConfig(
            **common,
            head_dim=hidden_size // 4,
            sliding_window=8,
            layer_types=layer_types,
            query_pre_attn_scalar=hidden_size // 4,
            final_logit_softcapping=30.0,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")


def tiny_model(arch: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides):
    """A seeded random model of ``arch`` in eval mode."""
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # random init is tiny; scale weights up so that the next-token distribution is peaked
    # enough for greedy decoding to be non-trivial (drafts get accepted sometimes)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4.0, generator=None)
    model.eval()
    return model


class ByteTokenizer:
    """A stand-in tokenizer for tiny models: one token per UTF-8 byte, ids offset by 4."""

    chat_template = None
    eos_token_id = 2
    offset = 4

    def __call__(self, text: str) -> dict:
        return {"input_ids": [b + self.offset for b in text.encode("utf-8")]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < 256 + self.offset).decode("utf-8", "replace")

    def get_vocab(self) -> dict:
        return {"<eos>": self.eos_token_id}


TINY_VOCAB = 256 + ByteTokenizer.offset
# what a tiny model's token ranking (selfspec.assets.vocab, head_ids=frequent) counts: no download
TINY_TEXTS = ("Sure! Here is a short answer, with an example:", "def add(a, b):\n    return a + b\n",
              "The result is 42. Let me know if you have any other questions.")
