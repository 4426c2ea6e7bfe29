"""The simulator's cache: every calibration prompt's full-model keys/values, one batch row each, plus scratch slots
where a batched, teacher-forced draft forward writes its chunk (a transformers ``Cache`` of this one use, so the
model's own attention reads it; the decoding loop's :class:`~selfspec.engine.cache.PositionalKVCache` holds one
sequence and is not batched)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class Chunk:
    """What the next batched draft forward writes: its rows of the cache, the first scratch slot, and
    where each row's new positions go past it (``place``'s ``offsets``, one per row, as ``scatter`` indices)."""

    __slots__ = ("rows", "start", "scatter", "slots")

    def __init__(self, start: int) -> None:
        self.rows: slice | torch.Tensor = slice(None)
        self.start = start
        # None: every row writes at the first scratch slot; else (row index [n, 1], slot index [n, width])
        self.scatter: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slots = 0  # scratch slots the forward reads: its widest row's offset + its width

    def place(self, rows: slice | torch.Tensor, offsets: list[int], width: int, device) -> None:
        """Built once a forward, not once a layer: the rows (a bounded slice or an index tensor), and where each
        row's new positions go."""
        self.rows = rows
        self.slots = max(offsets) + width
        if not any(offsets):
            self.scatter = None
            return
        index = torch.arange(rows.start, rows.stop, device=device) if isinstance(rows, slice) else rows
        start = torch.tensor(offsets, device=device) + self.start
        self.scatter = index[:, None], start[:, None] + torch.arange(width, device=device)[None, :]


class ChunkLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, chunk: Chunk, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.chunk, self.keys, self.values = chunk, keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("the simulator's cache is allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        chunk = self.chunk
        rows, a = chunk.rows, chunk.start  # rows: a slice (a view) or an index tensor (a copy)
        if chunk.scatter is None:
            width = key_states.shape[-2]
            self.keys[rows, :, a : a + width] = key_states
            self.values[rows, :, a : a + width] = value_states
        else:  # each row's new positions after the ones it already holds
            index, slots = chunk.scatter
            self.keys[index, :, slots] = key_states.transpose(1, 2)
            self.values[index, :, slots] = value_states.transpose(1, 2)
        end = a + chunk.slots
        return self.keys[rows, :, :end], self.values[rows, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.chunk.start + self.chunk.slots, 0

    def get_seq_length(self) -> int:
        return self.chunk.start

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class ChunkCache(Cache):
    """The full model's keys/values of every calibration prompt, one batch row each, plus scratch slots.

    Row ``b`` holds prompt ``b``'s full-model keys/values at slots = positions ``0 .. len-1``. A
    batched draft forward writes each row's chunk into the same scratch slots ``start ..`` (past
    every row's context) and attends, by its mask, to its own context below the round's first
    position and to its own chunk: the context slots are never overwritten, so nothing is restored.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        self.chunk = Chunk(start)
        super().__init__(layers=[ChunkLayer(self.chunk, k, v) for k, v in layers])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.chunk.start

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.chunk.start + self.chunk.slots, 0
