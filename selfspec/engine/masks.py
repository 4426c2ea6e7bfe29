"""Attention masks our loop passes to the model itself (draft trees).

The model's own mask is built from the cache's window; these are for forwards whose rows are
not a plain run of consecutive positions over the keys written so far: a draft tree's nodes
(:mod:`selfspec.engine.tree`).
"""

from __future__ import annotations

import torch


def layer_masks(model, allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor,
                device) -> torch.Tensor | dict[str, torch.Tensor]:
    """``allowed`` (``[queries, keys]``, true = attend) as the model takes it.

    For sliding-window layers (Gemma3, Qwen2 with a window) the window is applied on
    position ids as the model's own mask does (a key is seen while its position is above
    the query's minus the window); the model then gets one mask per layer type. Boolean
    ``[1, 1, queries, keys]`` for SDPA, additive float for eager attention.

    A batch of rows, each with its own mask and positions: ``allowed`` ``[batch, queries, keys]``,
    ``query_pos`` ``[batch, queries]``, ``key_pos`` ``[batch, keys]``; the masks are then
    ``[batch, 1, queries, keys]``.
    """
    if allowed.dim() == 2:
        allowed, query_pos, key_pos = allowed[None], query_pos[None], key_pos[None]
    config = model.config.get_text_config(decoder=True)
    masks = {"full_attention": allowed}
    layer_types = getattr(config, "layer_types", None) or []
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types and window:
        masks["sliding_attention"] = allowed & (key_pos[:, None, :] > query_pos[:, :, None] - window)
    dtype = next(model.parameters()).dtype
    eager = getattr(config, "_attn_implementation", "sdpa") == "eager"

    def prepared(m: torch.Tensor) -> torch.Tensor:
        m = m[:, None].to(device)
        if eager:
            return torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)
        return m

    if len(masks) == 1:
        return prepared(allowed)
    return {name: prepared(m) for name, m in masks.items()}

