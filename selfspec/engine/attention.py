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
cover (no mask over several rows, a mask that is not boolean or differs by head, dropout, soft-capping,
attention sinks, a position bias) go to transformers' SDPA function unchanged.

Row-invariance: each row's output is a function of its own keys in order and nothing else (not the forward's
other rows, not the keys past its own, not the columns its keys sit in), so a verify row computes bit for bit
what an AR step at its position computes (docs/numerics.md). A row's keys in order are the columns it attends,
in column order (:func:`frame`): for an AR step or a chain's verify a prefix of the cache; for a draft tree's
node the committed prefix and then its ancestors, gathered from slots among other nodes'.

bf16 rows go to a C++ kernel (``selfspec/kernels/csrc/row_attention.cpp``, in the int4 kernel's library, where that
builds: AVX-512 or AVX2) that reduces each row by itself over its keys in order: row-invariant by construction, and
faster than the products below (one row over 300 keys: ~0.06 against ~0.17 ms a layer, ``scripts/attention_bench.py``).
Elsewhere (another dtype, no kernel) the products keep the property by layout: each row's keys are
padded with zeros to ``L``, whole chunks of :data:`CHUNK`; its softmax runs over them in order (trailing masked
columns add exact zeros), and the sum over the values is two products, keys ``[0, L - 2 CHUNK)`` then the last two
chunks, added. A tree node's ancestors lie within its last two chunks (depth < :data:`CHUNK`), so the first
product reads the cache in place for every row of every forward, and only the last two chunks are gathered per
node. Every product has at least :data:`MIN_ROWS` rows and :data:`MIN_COLS` columns: the library's smaller
products take other paths. What this rests on (a library product gives each row and column the same bits
whatever the product's other rows and columns, above those sizes) is checked by
``tests/engine/test_row_invariance.py`` on the CPU it runs on, for both paths.

The function is registered with transformers' ``AttentionInterface`` (with SDPA's masks) under
:data:`NAME`, and :func:`decode_attention` switches one model instance to it inside a ``with``
block; no transformers class is changed.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from selfspec.kernels import vnni

NAME = "selfspec_decode"
ATTENTION = ("decode", "sdpa")  # DecodeConfig.attention: this module's, or the model's as loaded
MAX_ROWS = 32  # query rows up to which the matrix products serve (a draft tree's verify is at most ~30 rows)
CHUNK = 32  # each row's keys pad to whole chunks of this many (row-invariance)
ROW_INVARIANT = True  # DecodeConfig.row_invariant: every forward row-invariant unless a run says otherwise
# a model kwarg: the forward's first this many rows are its tokens, the rest padding whose outputs nobody reads
# (selfspec.engine.decoding.forward_at); on the row kernel a padding row attends its first key only
REAL_ROWS = "selfspec_real_rows"
# below these sizes the library's matrix products take other paths (a product of 1-3 rows, or of fewer than 12
# columns, rounds differently from the same rows and columns inside a larger one on the Zen 4's library): every
# product here is padded with zeros to at least this many rows and columns, so every row takes the same path
MIN_ROWS, MIN_COLS = 8, 16

_UNCOVERED = ("position_bias", "softcap", "s_aux", "sinks")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      chunk: int = CHUNK, kernel: bool = True, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: ``query`` ``[b, heads, q, d]``, ``key``/``value`` ``[b, kv_heads, keys, d]``,
    ``attention_mask`` boolean (true = attend), ``[b or 1, 1, q, keys]``; returns ``[b, q, heads, d]``.
    ``chunk``: the row-invariant reduction's chunk (module docstring); 1: the softmax and the sum over the values
    as the keys come (not row-invariant; for measuring what row-invariance costs). ``kernel``: bf16 rows go to the
    row-invariant C++ kernel where it runs (:func:`_on_kernel`); false: the matrix products here."""
    b, heads, rows, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    real = kwargs.pop(REAL_ROWS, None)
    if (rows > MAX_ROWS or (attention_mask is None and rows > 1) or dropout or heads % kv_heads
            or kwargs.get("output_attentions") or any(kwargs.get(k) is not None for k in _UNCOVERED)
            or value.shape[-1] != dim or (attention_mask is not None and (
                attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1))):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    acc = torch.promote_types(query.dtype, torch.float32)  # float32 for bf16/fp16, float64 stays
    if attention_mask is None:  # one row over every key
        allowed, plans = None, [_plan_one_row(keys, chunk)] * b
    else:
        allowed = attention_mask[:, 0, :, :keys].expand(b, rows, keys)
        plans = _plans_of(attention_mask, allowed, chunk, real)
    if chunk != 1 and kernel:
        out = _on_kernel(query, key, value, plans, scale)
        if out is not None:
            return out, None
    outs = []
    for i, plan in enumerate(plans):
        index, width, first = plan.index, plan.width, plan.first
        # heads h = j * group + u share key/value head j: rows (u, q) of one product per key/value head. The keys and
        # the values go to the accumulation type with zeros past them, to the plan's columns (whole chunks)
        cols = max(width, keys + (index is not None))  # a tree's gather reads column `keys` for "no key"
        k, v = (_padded(x[i], cols, acc) for x in (key, value))
        s = _bmm(query[i].reshape(kv_heads, group * rows, dim).to(acc), k.transpose(1, 2)).mul_(scale)
        s = s.view(1, kv_heads, group, rows, cols)
        s[..., keys:] = float("-inf")
        if allowed is not None:  # columns before `first` every row attends
            s[..., first:keys].masked_fill_(~allowed[i, None, None, None, :, first:], float("-inf"))
        if chunk == 1:
            outs.append(torch.bmm(s[..., :keys].reshape(kv_heads, group * rows, keys).softmax(-1), v[:, :keys]))
        else:
            outs.append(_row_invariant(s, v, plan))
    out = outs[0] if b == 1 else torch.cat([o.reshape(1, heads, rows, dim) for o in outs])
    return out.to(value.dtype).reshape(b, heads, rows, dim).transpose(1, 2).contiguous(), None


def _on_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plans: list, scale: float):
    """The output ``[b, rows, heads, d]`` from :func:`selfspec.kernels.vnni.row_attention` (each row's keys in
    order, reduced one row at a time: row-invariant by construction), or None where it does not serve: another
    dtype than bf16, keys not in rows of ``d`` contiguous values, or no kernel on this CPU."""
    if not (query.dtype == key.dtype == value.dtype == torch.bfloat16 and key.stride(-1) == value.stride(-1) == 1
            and key.stride(-2) == value.stride(-2) == key.shape[-1] and key.stride(1) == value.stride(1)):
        return None
    if not vnni.available() or key.shape[-1] % 16 or not all(plan.keyed for plan in plans):
        return None  # (a row that attends no key: SDPA's result for it, not the kernel's)
    outs = [vnni.row_attention(query[i], key[i], value[i], plan.count, plan.index, scale)
            for i, plan in enumerate(plans)]
    return outs[0][None] if len(outs) == 1 else torch.stack(outs)


def _padded(x: torch.Tensor, cols: int, acc: torch.dtype) -> torch.Tensor:
    """``x`` ``[kv, keys, d]`` in ``acc``, zeros past its keys up to ``cols``."""
    out = torch.empty(x.shape[0], cols, x.shape[-1], dtype=acc, device=x.device)
    out[:, : x.shape[1]] = x
    out[:, x.shape[1] :] = 0
    return out


def frame(allowed: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """Each row's keys in order: ``allowed`` ``[rows, keys]`` (true = attend) to ``(index, count, same)``.

    ``count[r]``: how many keys row ``r`` attends; ``index[r, j]``: the column of its ``j``-th key (the attended
    columns in column order, then ``keys`` for none), None where every row attends a prefix of the columns (an AR
    step, a chain's verify: the index would be the identity); ``same[r]``: how many of its first keys sit in their
    own column. A draft tree's row attends the committed prefix, then its ancestors in slots among other nodes':
    in order, the keys an AR step at its position attends, from other columns past the prefix."""
    count = allowed.sum(-1)
    columns = torch.arange(allowed.shape[-1], device=allowed.device)
    if torch.equal(allowed, columns < count[:, None]):
        return None, count, count
    index = torch.where(allowed, columns, allowed.shape[-1]).sort(-1).values
    return index, count, (index == columns).cumprod(-1).sum(-1)


class Plan(NamedTuple):
    """How one batch row's forward reduces (:func:`_row_invariant`)."""

    index: torch.Tensor | None  # each row's keys' columns in order (:func:`frame`); None: column j for every row
    width: int  # the columns the softmax runs over: the longest row's keys in whole chunks
    shared: int  # the leading columns every row reads in place, in whole chunks (the rest gathered per row)
    groups: list[tuple]  # (rows or None for all, length, split, per_row_head) for the rows whose keys pad to length
    first: int  # the leading columns every row attends in place
    count: torch.Tensor  # each row's number of keys (int64)
    keyed: bool  # every row attends a key


@functools.lru_cache(maxsize=64)
def _plan_one_row(keys: int, chunk: int) -> Plan:
    """:func:`_plan` for one row over all ``keys`` (an unmasked step)."""
    return _plan(torch.ones(1, keys, dtype=torch.bool), chunk)


def _plan(allowed: torch.Tensor, chunk: int) -> Plan:
    """The :class:`Plan` of one batch row's forward, from its mask ``allowed`` ``[rows, keys]``."""
    index, count, same = frame(allowed)
    length = ((count + chunk - 1) // chunk).clamp_min(1) * chunk
    width = int(length.max())
    first = int(same.min())
    shared = width if index is None else min(first // chunk * chunk, width)
    if index is not None and width > index.shape[-1]:
        index = torch.nn.functional.pad(index, (0, width - index.shape[-1]), value=allowed.shape[-1])
    groups = []
    for ell in sorted(set(length.tolist())):
        rows = (length == ell).nonzero().flatten()
        split = max(ell - 2 * chunk, 0)
        per_row_head = index is not None and bool((same[rows] < split).any())
        groups.append((None if len(rows) == len(length) else rows, ell, split, per_row_head))
    return Plan(index, width, shared, groups, first, count, bool((count > 0).all()))


_memo: list = [None, None]  # (a weak reference to the last mask, its plans): every layer of a forward gets one mask


def _plans_of(mask: torch.Tensor, allowed: torch.Tensor, chunk: int, real: int | None = None) -> list:
    """The plans of a forward's batch rows; ``real``: rows from this one on are padding, and their keys are cut to
    the first (the row kernel's count; their outputs are not read, and no other row depends on them)."""
    ref, cached = _memo
    if ref is not None and ref() is mask and cached[0] == (allowed.shape, chunk, real):
        return cached[1]
    plans = [_plan(a, chunk) for a in allowed]
    if real is not None and real < allowed.shape[1]:
        plans = [p._replace(count=torch.cat([p.count[:real], p.count[real:].clamp(max=1)])) for p in plans]
    _memo[0], _memo[1] = weakref.ref(mask), ((allowed.shape, chunk, real), plans)
    return plans


def _row_invariant(s: torch.Tensor, v: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Masked scores ``s`` ``[1, kv, group, rows, cols]`` (-inf past the keys) and the padded values ``v``
    ``[kv, cols, d]`` to the output ``[1, kv, group, rows, d]``, each row over its own keys in order (module
    docstring)."""
    index, width, shared, groups = plan.index, plan.width, plan.shared, plan.groups
    if index is None:
        f = s[..., :width]
    else:  # past the columns every row reads in place, each row's keys gathered in order (none: column `keys`)
        tail = torch.gather(s, -1, index[None, None, None, :, shared:width].expand(*s.shape[:-1], width - shared))
        f = torch.cat([s[..., :shared], tail], -1)
    probs = f.softmax(-1)
    if len(groups) == 1 and groups[0][0] is None:
        return _chunks(probs, v, index, *groups[0][1:])
    out = torch.empty(*probs.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device)
    for rows, ell, split, per_row_head in groups:
        out[:, :, :, rows] = _chunks(probs[:, :, :, rows], v, None if index is None else index[rows],
                                     ell, split, per_row_head)
    return out


def _chunks(probs: torch.Tensor, v: torch.Tensor, index: torch.Tensor | None, length: int, split: int,
            per_row_head: bool) -> torch.Tensor:
    """Rows whose keys pad to ``length``: the sum over the values as ``keys[:split]`` + ``keys[split:length]``."""
    tail = _reduce(probs, v, index, split, length)
    if not split:
        return tail
    return _reduce(probs, v, index if per_row_head else None, 0, split).add_(tail)


def _reduce(probs: torch.Tensor, v: torch.Tensor, index: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """``sum_j probs[..., j] * value(key j)`` over each row's keys ``lo..hi-1``: ``probs`` ``[1, kv, group, rows, W]``,
    ``v`` the padded values ``[kv, cols, d]``. ``index`` None: key ``j`` sits in column ``j`` for every row (one
    product, the rows stacked); else each row's keys are gathered from its own columns (a product per row)."""
    _, kv, g, rows = probs.shape[:4]
    p = probs[..., lo:hi]
    if index is None:
        return _bmm(p.reshape(kv, g * rows, hi - lo), v[:, lo:hi]).view(1, kv, g, rows, -1)
    vals = v[:, index[:, lo:hi].reshape(-1)]  # [kv, rows * (hi - lo), d]
    out = _bmm(p.transpose(2, 3).reshape(kv * rows, g, hi - lo), vals.view(kv * rows, hi - lo, -1))
    return out.view(1, kv, rows, g, -1).transpose(2, 3)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch.bmm(a, b)`` computed with at least :data:`MIN_ROWS` rows and :data:`MIN_COLS` columns (zeros)."""
    m, n = a.shape[1], b.shape[2]
    if m >= MIN_ROWS and n >= MIN_COLS:
        return torch.bmm(a, b)
    if m < MIN_ROWS:
        a = torch.nn.functional.pad(a, (0, 0, 0, MIN_ROWS - m))
    if n < MIN_COLS:
        b = torch.nn.functional.pad(b, (0, MIN_COLS - n))
    return torch.bmm(a, b)[:, :m, :n]


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
def decode_attention(model, on: bool = True, row_invariant: bool = ROW_INVARIANT) -> Iterator[None]:
    """Inside the block, ``model`` (one instance) attends through :func:`attention_forward` where it ran SDPA.

    A model on another implementation (eager, flex) keeps it; nested blocks are one. ``row_invariant``: every
    forward row-invariant (true), or the keys reduced as they come (false).
    """
    chunk = CHUNK if row_invariant else 1
    before = implementation(model)
    if not on or before != "sdpa" or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(_register(chunk))
    try:
        yield
    finally:
        model.set_attn_implementation(before)
