"""Attention for decode-sized forwards: a few query rows over the cache as two batched matrix products.

torch's CPU SDPA runs its flash kernel even for one query row, and there it costs more than
everything else in the layer but the weights: on a 2-core Zen 4 EPYC (``docs/log.md``) one
row over 1000 cached keys took 1.34 ms per layer (12 heads on 2 key/value heads, head dim 128),
against 0.22 ms here (``scripts/attention_bench.py``). A draft step is one row,
so the draft paid most of it; a verify or a padded step of 4-6 rows paid about half.

Here the query heads that share a key/value head are stacked as rows of one matrix product
over that head's keys (no repeated keys), in float32 throughout (float64 models stay in float64): the
keys and the values are converted, and the output is rounded to the model's dtype once. A bf16 product
of the probabilities and the values runs on a slow path where the CPU has no bf16 instructions (AVX2):
there the attention took 11.4 ms a layer for 6 rows over 1000 keys, against 1.14 ms in float32
(``scripts/attention_bench.py``, docs/log.md). Forwards of
more than :data:`MAX_ROWS` query rows (a prompt's prefill) and everything this path does not
cover (no mask over several rows, dropout, soft-capping, attention sinks, a position bias) go to
transformers' SDPA function unchanged.

The function is registered with transformers' ``AttentionInterface`` (with SDPA's masks) under
:data:`NAME`, and :func:`decode_attention` switches one model instance to it inside a ``with``
block; no transformers class is changed.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

NAME = "selfspec_decode"
ATTENTION = ("decode", "sdpa")  # DecodeConfig.attention: this module's, or the model's as loaded
MAX_ROWS = 32  # query rows up to which the matrix products serve (a draft tree's verify is at most ~30 rows)
CHUNK = 32  # the sum over the values runs over whole chunks of this many keys (row-invariance)

_UNCOVERED = ("position_bias", "softcap", "s_aux", "sinks")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      chunk: int = CHUNK, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, keys, d]``,
    ``attention_mask`` boolean (true = attend) or additive, ``[b or 1, 1 or heads, q, keys]``; returns
    ``[b, q, heads, d]``. ``chunk``: the key count is padded to whole chunks of it (1: no padding, not
    row-invariant; for measuring what the padding costs)."""
    b, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    if (rows > MAX_ROWS or (attention_mask is None and rows > 1) or dropout or heads % kv_heads
            or kwargs.get("output_attentions") or any(kwargs.get(k) is not None for k in _UNCOVERED)
            or value.shape[-1] != dim):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    # heads h = j * group + i share key/value head j: rows (i, q) of one product per (batch, j)
    acc = torch.promote_types(query.dtype, torch.float32)  # float32 for bf16/fp16, float64 stays
    q = query.reshape(b * kv_heads, group * rows, dim).to(acc)
    scores = torch.bmm(q, key.reshape(b * kv_heads, keys, dim).to(acc).transpose(1, 2)).mul_(scale)
    if attention_mask is not None:
        m = attention_mask[..., :keys].expand(b, heads, rows, keys).reshape(b * kv_heads, group * rows, keys)
        if m.dtype == torch.bool:
            scores.masked_fill_(~m, float("-inf"))
        else:
            scores.add_(m)
    # the sum over the values runs over a key count padded to whole chunks of CHUNK (probability exactly 0, values
    # 0): the product's reduction is then split the same way whatever the forward's width, so a row's result
    # depends only on its own keys (row-invariance; tests/engine/test_row_invariance.py)
    padded = -(-keys // chunk) * chunk
    v = torch.empty(b * kv_heads, padded, dim, dtype=acc)
    v[:, :keys] = value.reshape(b * kv_heads, keys, dim)
    v[:, keys:] = 0
    if padded > keys:
        scores = torch.nn.functional.pad(scores, (0, padded - keys), value=float("-inf"))
    out = torch.bmm(scores.softmax(-1), v).to(value.dtype)
    return out.reshape(b, heads, rows, dim).transpose(1, 2).contiguous(), None


def _register(chunk: int) -> str:
    """The name under which transformers finds this module's attention with keys padded to ``chunk``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    name = NAME if chunk == CHUNK else f"{NAME}_chunk{chunk}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, functools.partial(attention_forward, chunk=chunk))
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    return name


def implementation(model) -> str | None:
    """The attention implementation ``model`` (or a layer that holds its config) runs now: ``sdpa``, ``eager``,
    :data:`NAME` inside :func:`decode_attention`; transformers keeps it in the config's ``_attn_implementation``."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


@contextmanager
def decode_attention(model, on: bool = True, chunk: int = CHUNK) -> Iterator[None]:
    """Inside the block, ``model`` (one instance) attends through :func:`attention_forward` where it ran SDPA.

    A model on another implementation (eager, flex) keeps it; nested blocks are one. ``chunk``: see
    :func:`attention_forward` (the default keeps every forward row-invariant).
    """
    before = implementation(model)
    if not on or before != "sdpa" or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(_register(chunk))
    try:
        yield
    finally:
        model.set_attn_implementation(before)
