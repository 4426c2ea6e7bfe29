"""Our fp16 panel kernel (selfspec.kernels.fp16): the layout round trip, products against fp64 over the row counts and
shapes its blocks split differently, bf16 panels for weights fp16 does not hold, and row-invariance."""

from __future__ import annotations

import pytest
import torch

from selfspec.kernels import fp16

pytestmark = pytest.mark.skipif(not fp16.available(), reason="our fp16 kernel does not run here (see fp16.unavailable_reason)")


def _fp16_exact(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).half().to(torch.bfloat16)  # values fp16 and bf16 both hold


@pytest.mark.parametrize("n, k", [(40, 300), (256, 1536), (17, 33), (1, 16), (100, 896)])
def test_panels_hold_the_weight_exactly(n, k):
    w = _fp16_exact(n, k, 0)
    panels = fp16.pack(w)
    assert panels.shape == (-(-n // 16), k, 16) and panels.dtype == torch.float16
    assert torch.equal(fp16.unpack(panels, n).to(torch.bfloat16), w)
    if n % 16:
        assert torch.all(panels[-1, :, n % 16:] == 0)  # the padding outputs are zeros


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 12, 13, 16, 64])
@pytest.mark.parametrize("n, k, bias", [(40, 300, True), (256, 1536, False), (33, 517, True)])
def test_products_match_fp64_in_fp32_and_round_once_in_bf16(rows, n, k, bias):
    w = _fp16_exact(n, k, rows)
    g = torch.Generator().manual_seed(100 + rows)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(1, rows, k, generator=g)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    got32 = fp16.linear(x, fp16.pack(w), b, n)
    assert got32.shape == (1, rows, n) and got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, rtol=1e-5, atol=1e-5 * k ** 0.5)
    xb = x.to(torch.bfloat16)
    want_b = (xb.double() @ w.double().T + (0 if b is None else b.double())).float()
    got_b = fp16.linear(xb, fp16.pack(w), b, n)
    assert got_b.dtype == torch.bfloat16
    # one rounding of an fp32 sum to bf16: within one bf16 step of the exact value (+ the fp32 sums' own error)
    assert torch.all((got_b.float() - want_b).abs() <= want_b.abs() * 2 ** -8 + 1e-5 * k ** 0.5)


def test_shapes_that_do_not_fit_are_refused():
    w = fp16.pack(_fp16_exact(20, 32, 0))
    with pytest.raises(RuntimeError, match="does not fit"):
        fp16.linear(torch.randn(2, 31), w, None, 20)
    with pytest.raises(RuntimeError, match="does not fit"):
        fp16.linear(torch.randn(2, 32), w, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        fp16.linear(torch.randn(2, 32), w, torch.randn(19), 20)


def _bf16_only(n: int, k: int, seed: int) -> torch.Tensor:
    """A bf16 weight with values fp16 does not hold (below its subnormals' exact range) among ordinary ones."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    w[:, ::7] = (torch.randn(n, len(range(0, k, 7)), generator=g) * 2.0 ** -20).to(torch.bfloat16)
    assert not torch.equal(w.half().float(), w.float())
    return w


def test_bf16_panels_hold_any_bf16_weight_and_other_dtypes_are_refused():
    w = _bf16_only(40, 300, 0)
    panels = fp16.pack(w, torch.bfloat16)
    assert panels.shape == (3, 300, 16) and panels.dtype == torch.bfloat16
    assert torch.equal(fp16.unpack(panels, 40), w)
    with pytest.raises(ValueError, match="fp16 or bf16"):
        fp16.pack(w, torch.float32)


@pytest.mark.parametrize("n, k", [(40, 300), (256, 1536), (33, 517)])
def test_bf16_panels_compute_what_fp16_panels_compute(n, k):
    """The kernel widens either to the same fp32 weights and sums them in the same order: the same bits."""
    w = _fp16_exact(n, k, 3)
    x = torch.randn(7, k, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    b = torch.randn(n)
    assert torch.equal(fp16.linear(x, fp16.pack(w, torch.bfloat16), b, n), fp16.linear(x, fp16.pack(w), b, n))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(40, 300), (256, 1536)])
def test_every_row_computes_the_same_bits_whatever_the_call_s_row_count(dtype, n, k):
    """Row-invariance, which exact greedy verifies rest on: row i of an m-row call equals a one-row call on it."""
    w = _fp16_exact(n, k, 5) if dtype == torch.float16 else _bf16_only(n, k, 5)
    panels = fp16.pack(w, dtype)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ones = [fp16.linear(x[i:i + 1], panels, None, n) for i in range(16)]
    for rows in range(1, 17):
        got = fp16.linear(x[:rows], panels, None, n)
        assert all(torch.equal(got[i:i + 1], ones[i]) for i in range(rows)), rows
    want = (x.double() @ w.double().T).float()
    got = fp16.linear(x, panels, None, n).float()
    assert torch.all((got - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * k ** 0.5)


@pytest.mark.parametrize("rows", [129, 300])
def test_a_prefill_s_rows_compute_the_bits_of_one_row_calls(rows):
    """Calls of over 128 rows run in parts on the AVX2 build: every row still gets a one-row call's bits."""
    n, k = 40, 300
    w = _fp16_exact(n, k, 7)
    panels = fp16.pack(w)
    b = torch.randn(n, generator=torch.Generator().manual_seed(8))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got = fp16.linear(x, panels, b, n)
    ones = torch.cat([fp16.linear(x[i:i + 1], panels, b, n) for i in range(rows)])
    assert got.shape == (rows, n) and torch.equal(got, ones)
    want = (x.double() @ w.double().T + b.double()).float()
    assert torch.all((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * k ** 0.5)
