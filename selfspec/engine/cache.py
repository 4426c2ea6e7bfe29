"""One preallocated KV cache, written at absolute positions set by the caller.

:class:`PositionalKVCache` is a `transformers.Cache` whose layers hold
``[batch, kv_heads, max_len, head_dim]`` tensors allocated once. Before each
forward the decoding loop calls :meth:`PositionalKVCache.seek` with the
absolute position of the first new token; every attention layer that runs
then writes its keys/values into slots ``start .. start+n-1`` and attends to
slots ``0 .. start+n-1``. Nothing is inferred from a layer's own length:
a layer whose attention a draft skips simply is not written, and the mask
offset comes from the loop.

Invariants:
- rollback is free: rejecting drafted tokens is ``seek``-ing back; later
  forwards overwrite the stale slots, and no forward reads past its own end;
- a slot below ``start`` in a layer is only ever read if that layer wrote it
  (the verify pass writes every layer at every position it covers);
- sliding-window layers keep the full history too; the model's own sliding
  mask hides what lies outside the window, so rollback stays free there.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from selfspec.errors import SelfSpecError
from selfspec.model.arch import num_layers


@functools.cache
def _cache_keyword(forward_type: type) -> str:
    params = inspect.signature(forward_type.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model, cache: Cache) -> dict:
    """``cache`` as the keyword argument ``model``'s forward takes it by: ``cache`` from transformers 5.24 on,
    where ``past_key_values`` is deprecated (a FutureWarning on every call), ``past_key_values`` before."""
    return {_cache_keyword(type(model)): cache}


class _Window:
    """The slots the next forward writes, ``start .. end-1``, the keys it attends over, ``0 .. keys-1``
    (``end``, or the whole cache with fixed keys), and whether its rows attend causally (row i to slots
    ``0 .. start+i``: every forward but one with its own mask and positions, a draft tree's verify)."""

    __slots__ = ("start", "end", "keys", "causal")

    def __init__(self) -> None:
        self.start = 0
        self.end = 0
        self.keys = 0
        self.causal = True


class _PositionalLayer(CacheLayerMixin):
    is_compileable = False
    is_croppable = False
    supports_early_init = True

    def __init__(self, window: _Window, max_len: int, sliding: bool) -> None:
        super().__init__()
        self.window = window
        self.max_len = max_len
        self.is_sliding = sliding

    def allocate(self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        shape = (batch, kv_heads, self.max_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.allocate(b, h, d, key_states.dtype, key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.window.start, self.window.end
        if key_states.shape[-2] != end - start:
            raise RuntimeError(
                f"cache window holds {end - start} slots but the layer got {key_states.shape[-2]} tokens; "
                "call PositionalKVCache.seek before each forward"
            )
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        keys = self.window.keys
        return self.keys[:, :, :keys], self.values[:, :, :keys]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window.keys, 0

    def get_seq_length(self) -> int:
        return self.window.start

    def get_max_length(self) -> int:
        return self.max_len


class PositionalKVCache(Cache):
    """Preallocated KV cache for one sequence; the caller owns positions.

    API used by the decoding loop: :meth:`seek` (set the write window of the
    next forward), :meth:`move_rows` and :attr:`max_len`. Everything else is the
    `transformers.Cache` interface the model's attention layers call.
    """

    def __init__(self, model, max_len: int, batch_size: int = 1) -> None:
        config = model.config.get_text_config(decoder=True)
        n = num_layers(model)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * n
        self.window = _Window()
        self._max_len = int(max_len)
        layers = [_PositionalLayer(self.window, self._max_len, t == "sliding_attention") for t in layer_types[:n]]
        super().__init__(layers=layers)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        param = next(model.parameters())
        for layer in self.layers:
            layer.allocate(batch_size, kv_heads, head_dim, param.dtype, param.device)

    @property
    def max_len(self) -> int:
        return self._max_len

    def seek(self, start: int, length: int, causal: bool = True) -> None:
        """Let the next forward write ``length`` tokens at absolute positions ``start..``; ``causal``: its rows
        attend causally over the slots (false for a forward with its own mask)."""
        end = start + length
        if start < 0 or length < 1 or end > self._max_len:
            raise SelfSpecError(
                f"cache holds {self._max_len} positions; cannot write positions {start}..{end - 1}"
            )
        self.window.start = start
        self.window.end = end
        self.window.keys = end
        self.window.causal = causal

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys/values of slots ``src`` to slots ``dst`` in every layer (a tree's accepted path).

        Only these rows are copied, never the cache; all sources are read before any destination is written.
        """
        if not src:
            return
        device = self.layers[0].keys.device
        s = torch.tensor(src, dtype=torch.long, device=device)
        d = torch.tensor(dst, dtype=torch.long, device=device)
        for layer in self.layers:
            layer.keys[:, :, d] = layer.keys[:, :, s]
            layer.values[:, :, d] = layer.values[:, :, s]

    # transformers.Cache: everything size-related comes from the window, never from a layer
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.window.start

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.window.start

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.window.keys, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_len
