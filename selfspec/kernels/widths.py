"""Which widths of a packed bf16 product give each row the same bits, probed on this CPU.

oneDNN chooses a product's code path by its shape, the number of rows included, and two paths may sum a row's
products in different orders. A row of a verify would then get other bits than the same row in a one-row step, and
greedy self-speculative decoding could part from greedy AR at a near-tie. Which widths share a path is oneDNN's
business and differs by CPU and by weight shape: on a 2-core AMD EPYC Zen 4 a one-row product differs from every
wider one; on a 2-core Intel Xeon with AMX one-row products share the bits of wider ones, except that the
Qwen2.5-Coder-1.5B's down projections (1536 outputs, 8960 inputs) give other bits at 12-23 rows than at 1-11 and
24-32 with 2 threads (docs/numerics.md). So the rule is asked of oneDNN itself, once per weight shape and thread count:

- :func:`pad_table` times nothing; it computes rows of random inputs once in products of ``base`` rows (the
  reference: the loop's narrowest forward) and once in a product of every width from ``base`` to :data:`MAX_ROWS`,
  and maps each width whose rows differ from the reference to the next wider width whose rows do not (where none
  does, to a narrower one); :class:`~selfspec.kernels.packed.PackedLinear` pads such inputs with zero rows up to it
  (the rows are independent, so the padding changes no other row's bits) or splits them there;
- :func:`one_row_exact` says whether one-row products share the bits of wider ones here; where they do not, the
  loop pads every forward to several rows (:func:`~selfspec.kernels.packed.default_rows`).

The invariant kept: on a CPU that packs bf16 weights, a row's product through a packed linear has the same bits in
every forward of ``base`` to :data:`MAX_ROWS` rows, wherever some width of the reference's path exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

MAX_ROWS = 32  # the widest forward of the decode loop (its attention's limit); wider ones are prefills

Product = Callable[[torch.Tensor], torch.Tensor]


def mkldnn_product(packed: torch.Tensor, bias: torch.Tensor | None) -> Product:
    """oneDNN's product of bf16 rows with a prepacked bf16 weight."""
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def probe(product: Product, in_features: int, base: int, max_rows: int = MAX_ROWS) -> tuple[int, ...]:
    """How a product of ``m`` rows runs (index ``m``, 0..``max_rows``): ``m`` where its rows get the bits of the same
    rows in products of ``base`` rows; else the next wider width that does (padded to it), else a narrower one that
    does, at least ``base`` rows narrower (the rows split there: the weight is read twice); ``m`` where none does.
    Widths under ``base`` are left as they are."""
    x = torch.randn(max_rows + base, in_features, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    reference = torch.cat([product(x[s:s + base]) for s in range(0, max_rows, base)])[:max_rows]
    exact = {m: torch.equal(product(x[:m]), reference[:m]) for m in range(base, max_rows + 1)}
    table = list(range(max_rows + 1))
    for m in range(base, max_rows + 1):
        if not exact[m]:
            wider = [w for w in range(m + 1, max_rows + 1) if exact[w]]
            narrower = [w for w in range(base, m - base + 1) if exact[w]]
            table[m] = wider[0] if wider else narrower[-1] if narrower else m
    return tuple(table)


_TABLES: dict[tuple, tuple[int, ...]] = {}


def pad_table(packed: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int,
              base: int) -> tuple[int, ...]:
    """:func:`probe` for this packed weight's shape, once per shape, bias, ``base`` and thread count."""
    key = (out_features, in_features, bias is not None, base, torch.get_num_threads())
    if key not in _TABLES:
        _TABLES[key] = probe(mkldnn_product(packed, bias), in_features, base)
    return _TABLES[key]


@functools.cache
def one_row_exact() -> bool:
    """Whether oneDNN's one-row bf16 products share the bits of 2-16-row ones here (a 512x1536 weight probed)."""
    w = torch.randn(512, 1536, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    table = probe(mkldnn_product(torch.ops.mkldnn._reorder_linear_weight(w, 1), None), 1536, 1, max_rows=16)
    return all(table[m] == m for m in range(1, 17))


def padded(product: Product, x: torch.Tensor, table: tuple[int, ...]) -> torch.Tensor:
    """``product(x)`` at the width ``table`` gives for ``x``'s rows: padded with zero rows up to it, or split there."""
    rows = x.numel() // x.shape[-1]
    width = table[rows] if rows < len(table) else rows
    if width == rows:
        return product(x)
    flat = x.reshape(rows, x.shape[-1])
    if width > rows:
        y = product(torch.cat([flat, flat.new_zeros(width - rows, flat.shape[1])]))[:rows]
    else:
        y = torch.cat([product(flat[:width]), padded(product, flat[width:], table)])
    return y.reshape(*x.shape[:-1], y.shape[-1])
