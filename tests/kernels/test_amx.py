"""Our bf16 panel kernel (selfspec.kernels.amx), on AMX tiles or AVX-512's bf16 dot product, whichever build runs
here: the layout round trip, products against fp64 over the row counts and shapes its tiles and register blocks split
differently, row-invariance, and a model packed for it decoding greedily as our loop does on its weights as loaded.
Skipped where neither build runs (a CPU without AMX or AVX-512 BF16, a Linux that does not grant the tiles)."""

from __future__ import annotations

import pytest
import torch

from selfspec.kernels import amx
from selfspec.kernels.packed import PackedLinear

pytestmark = pytest.mark.skipif(not amx.available(), reason="our AMX kernel does not run here (amx.unavailable_reason)")


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)


@pytest.mark.parametrize("n, k", [(40, 300), (256, 1536), (17, 33), (1, 16), (100, 896)])
def test_panels_hold_the_weight_exactly_with_zeros_past_it(n, k):
    w = _weight(n, k, 0)
    panels = amx.pack(w)
    kp = -(-k // 32) * 32
    assert panels.shape == (-(-n // 16), kp // 2, 16, 2) and panels.dtype == torch.bfloat16
    assert torch.equal(amx.unpack(panels, n, k), w)
    full = amx.unpack(panels, panels.shape[0] * 16, kp)
    assert torch.all(full[n:] == 0) and torch.all(full[:, k:] == 0)
    with pytest.raises(ValueError, match="bf16 weights"):
        amx.pack(w.float())


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 17, 40])
@pytest.mark.parametrize("n, k, bias", [(40, 300, True), (256, 1536, False), (33, 517, True), (130, 64, False)])
def test_products_match_fp64_and_round_once_to_bf16(rows, n, k, bias):
    w = _weight(n, k, rows)
    g = torch.Generator().manual_seed(100 + rows)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(1, rows, k, generator=g).to(torch.bfloat16)
    want = (x.double() @ w.double().T + (0 if b is None else b.double())).float()
    got = amx.linear(x, amx.pack(w), b, n)
    assert got.shape == (1, rows, n) and got.dtype == torch.bfloat16
    # bf16 x bf16 products are exact in fp32; one rounding of the fp32 sum to bf16, plus the fp32 sums' own error
    assert torch.all((got.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-5 * k ** 0.5)


@pytest.mark.parametrize("rows", [1, 7, 20, 37])
def test_each_output_is_its_fp32_sum_plus_bias_rounded_once_to_nearest_even(rows):
    """Each output is rounded once to bf16 as torch's conversion rounds: with weights of one nonzero input the fp32 sum
    is exact, so the output must be bf16(x * w + bias) bit for bit; a NaN input gives NaNs (their bits may differ)."""
    n, k = 37, 64
    w = torch.zeros(n, k, dtype=torch.bfloat16)
    w[:, 5] = torch.randn(n, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    x[0, 5] = float("nan")
    bias = torch.randn(n, generator=torch.Generator().manual_seed(10))
    want = (x[:, 5:6].float() * w[:, 5].float() + bias).to(torch.bfloat16)  # one product: exact in fp32
    got = amx.linear(x, amx.pack(w), bias, n)
    assert got[0].isnan().all() and torch.equal(got[1:].view(torch.int16), want[1:].view(torch.int16))


def test_shapes_that_do_not_fit_are_refused():
    w = amx.pack(_weight(20, 64, 0))
    with pytest.raises(RuntimeError, match="rounded up to 32"):
        amx.linear(torch.randn(2, 65).to(torch.bfloat16), w, None, 20)
    with pytest.raises(RuntimeError, match="rounded up to 32"):
        amx.linear(torch.randn(2, 32).to(torch.bfloat16), w, None, 20)
    with pytest.raises(RuntimeError, match="does not fit"):
        amx.linear(torch.randn(2, 64).to(torch.bfloat16), w, None, 40)
    with pytest.raises(RuntimeError, match="bias"):
        amx.linear(torch.randn(2, 64).to(torch.bfloat16), w, torch.randn(19), 20)


@pytest.mark.parametrize("n, k", [(40, 300), (256, 1536), (72, 8960)])
def test_every_row_computes_the_same_bits_whatever_the_call_s_row_count(n, k):
    """Row-invariance, which exact greedy verifies rest on: row i of an m-row call equals a one-row call on it, for
    calls within one tile's 16 rows and beyond them (16 rows a block: 17-40 rows, full blocks and partial ones; the
    dot build's blocks of 6 rows on 4 panels and of 12 on 2, with a weight's last panels one at a time)."""
    panels = amx.pack(_weight(n, k, 5))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ones = [amx.linear(x[i:i + 1], panels, None, n) for i in range(40)]
    for rows in (*range(1, 17), 18, 20, 31, 32, 33, 40):
        got = amx.linear(x[:rows], panels, None, n)
        assert all(torch.equal(got[i:i + 1], ones[i]) for i in range(rows)), rows
    got = amx.linear(x[3:10], panels, None, n)  # and wherever the row sits in the call
    assert all(torch.equal(got[i:i + 1], ones[3 + i]) for i in range(7))


def test_a_linear_packed_for_amx_computes_on_its_panels_and_gives_its_weight_back():
    lin = torch.nn.Linear(300, 40).to(torch.bfloat16)
    weight, bias = lin.weight.detach().clone(), lin.bias.detach().float()
    packed = PackedLinear(lin, kind="amx")
    assert packed.kind == "amx" and not packed.panels and packed.extra_bytes == 48 * 320 * 2  # 3 panels of 16, 320 inputs
    x = torch.randn(3, 300).to(torch.bfloat16)
    packed.active = True
    want = amx.linear(x, amx.pack(weight), bias, 40)
    assert torch.equal(packed(x), want)
    packed.drop_dense()
    assert torch.equal(packed.weight, weight) and torch.equal(packed(x), want) and packed.extra_bytes == 0


def test_a_prefill_runs_on_the_tiles_up_to_its_threshold_and_on_the_stock_kernel_from_it():
    from selfspec.kernels import packed as packed_module

    lin = PackedLinear(torch.nn.Linear(64, 40).to(torch.bfloat16), kind="amx")
    if not packed_module.packing_supported():
        pytest.skip("oneDNN does not pack bf16 here: every row count runs on the tiles")
    assert lin.stock_from == packed_module.PREFILL_MIN_ROWS["amx"] > 64
    lin.active = True
    with torch.inference_mode():
        wide = torch.randn(lin.stock_from, 64).to(torch.bfloat16)
        assert torch.equal(lin(wide), lin.inner(wide))  # the stock kernel's bits
        prompt = wide[:300]  # a prompt of a few hundred tokens: on the tiles
        assert torch.equal(lin(prompt), amx.linear(prompt, lin.packed, lin.bias32, 40))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_self_speculative_decoding_on_amx_tiles_is_token_identical_to_ar(make_model, arch):
    """A model packed for the AMX kernel, whatever this CPU's default packing: chains and trees, drafts that skip,
    quantize and copy, token for token what AR emits on the same weights."""
    from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
    from selfspec.draft.path import DraftOptions, DraftPath
    from selfspec.kernels.packed import weight_packer

    model = make_model(arch, torch.bfloat16)
    packer = weight_packer(model, kind="amx")
    assert {lin.kind for lin in packer.linears} == {"amx"}
    prompt = list(range(3, 40))
    cfg = DecodeConfig(max_new_tokens=24, k=4, fallback=False)
    ar = autoregressive(model, prompt, cfg).tokens
    for plan, opts in ((SkipPlan(4, attn=(1,), mlp=(2,)), DraftOptions()),
                       (SkipPlan(4, mlp=(1, 3)), DraftOptions(weights="int8", ngram=1, copy_tokens=6)),
                       (SkipPlan(4, mlp=(0,)), DraftOptions(weights="int4", group_size=32, branch_below=0.6,
                                                            tree_nodes=10))):
        sp = self_speculative(model, prompt, plan, cfg, draft=DraftPath(model, plan, opts))
        assert sp.tokens == ar, (arch, plan.describe(), opts)
