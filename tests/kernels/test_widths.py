"""The widths packed bf16 products run at, so that a row gets the same bits in any forward (selfspec.kernels.widths)."""

from __future__ import annotations

import pytest
import torch

from selfspec.kernels import packed, widths


def _banded(w: torch.Tensor, band: range):
    """A product whose rows are summed in another order (the inputs' halves rounded apart) at the widths of ``band``."""
    half = w.shape[1] // 2

    def product(x: torch.Tensor) -> torch.Tensor:  # row by row: a row's sums never depend on the other rows
        if x.shape[0] in band:
            return torch.stack([(w[:, :half].float() @ r[:half].float()).bfloat16()
                                + (w[:, half:].float() @ r[half:].float()).bfloat16() for r in x])
        return torch.stack([(w.float() @ r.float()).bfloat16() for r in x])

    return product


def test_widths_whose_rows_differ_run_at_the_next_width_that_does_not():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    table = widths.probe(_banded(w, range(5, 9)), 256, base=1, max_rows=12)
    assert table == (0, 1, 2, 3, 4, 9, 9, 9, 9, 9, 10, 11, 12)
    assert widths.probe(_banded(w, range(10, 13)), 256, base=1, max_rows=12)[10:] == (9, 9, 9)  # nothing wider: split
    assert widths.probe(_banded(w, range(1, 13)), 256, base=2, max_rows=12) == tuple(range(13))  # no width: as it is
    # a one-row product of another path: a base of 2 leaves it alone and checks 2 rows up against 2-row products
    assert widths.probe(_banded(w, range(1, 2)), 256, base=2, max_rows=12) == tuple(range(13))
    # with a base of 1 every wider width differs from the reference and runs row by row: hence a base of 6 there
    assert widths.probe(_banded(w, range(1, 2)), 256, base=1, max_rows=12) == (0,) + (1,) * 12


def test_a_padded_product_gives_each_row_the_bits_of_the_width_it_ran_at():
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    product = _banded(w, range(5, 9))
    table = widths.probe(product, 256, base=1, max_rows=12)
    x = torch.randn(1, 6, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = widths.padded(product, x, table)
    assert y.shape == (1, 6, 48)
    rows = torch.cat([product(x[0, i : i + 1]) for i in range(6)])
    assert torch.equal(y[0], rows) and not torch.equal(product(x[0]), rows)  # unpadded, the band's order shows
    wide = torch.randn(40, 256).bfloat16()  # wider than the table: as it is
    assert torch.equal(widths.padded(product, wide, table), product(wide))
    split = widths.probe(_banded(w, range(10, 13)), 256, base=1, max_rows=12)
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(widths.padded(_banded(w, range(10, 13)), x, split), product(x))  # 9 rows, then 2


@pytest.mark.parametrize("shape", [(1536, 8960), (8960, 1536), (256, 1536)])
def test_a_packed_bf16_linear_gives_a_row_the_same_bits_in_every_forward_the_loop_runs(shape, monkeypatch):
    """Qwen2.5-Coder-1.5B's shapes (down, up, k/v with a bias), random weights, on this CPU's oneDNN: every width from
    the loop's narrowest to 32 rows against the rows in products of the narrowest width (bf16 packs asked for where
    the CPU's default is another packing, as with AMX)."""
    if not packed.packing_supported():
        pytest.skip("oneDNN does not pack bf16 weights on this CPU")
    monkeypatch.setattr(packed, "pack_format", lambda: "bf16")
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(in_features, out_features, bias=out_features == 256).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(shape, generator=gen) * 0.02)
        wrapped = packed.PackedLinear(lin)
        wrapped.active = True
        base = packed.default_rows()
        x = torch.randn(32 + base, in_features, generator=gen).bfloat16()
        reference = torch.cat([wrapped(x[s : s + base]) for s in range(0, 32, base)])
        differ = [m for m in range(base, 33) if not torch.equal(wrapped(x[:m]), reference[:m])]
    assert not differ, f"{shape}: rows differ at widths {differ} (padded to {wrapped.widths})"


def test_the_loop_pads_to_several_rows_only_where_one_row_products_differ(monkeypatch):
    monkeypatch.setattr(packed, "pack_format", lambda: "bf16")
    for exact, rows in ((True, 1), (False, 6)):
        monkeypatch.setattr(widths, "one_row_exact", lambda exact=exact: exact)
        assert packed.default_rows() == rows


def test_the_fingerprint_says_where_bf16_products_may_run_on_amx_tiles(monkeypatch):
    from selfspec.kernels import vnni
    from selfspec.provenance import machine_fingerprint

    isa = torch.backends.cpu.get_cpu_capability()
    monkeypatch.setattr(vnni, "cpu_flags", lambda: {"avx512f", "amx_bf16", "amx_tile"})
    assert machine_fingerprint()["isa"] == f"{isa} AMX"
    monkeypatch.setattr(vnni, "cpu_flags", lambda: {"avx512f"})
    assert machine_fingerprint()["isa"] == isa
