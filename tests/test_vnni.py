"""The VNNI int4 kernel (selfspec.draft.vnni): layout, numbers, choice, and exact drafts through it."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft import vnni
from selfspec.draft.lowbit import LowPrecisionLinear, int4_kernel, quantize, quantized_mm
from selfspec.draft.path import DraftOptions, DraftPath
from tests.conftest import PROMPT

needs_vnni = pytest.mark.skipif(not vnni.available(), reason=f"VNNI int4 kernel: {vnni.unavailable_reason()}")


def _reference(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """What the kernel computes, in float64: the int4 weights (torch's groups) times the activations rounded to
    int8 per block of 64 inputs."""
    kernel, packed, sz = quantize(w, "int4", group, kernel="int4-vnni")
    q = vnni.unpack(packed).double()
    scale, zero = (sz[..., i].double().repeat_interleave(group, dim=1) for i in (0, 1))
    wd = (q - 8) * scale + zero
    xb = x.double().reshape(x.shape[0], -1, 64)
    s = xb.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(xb / torch.where(s > 0, s, 1)).clamp(-127, 127) * s).reshape(x.shape)
    return xq @ wd.t()


def test_pack_and_unpack_are_inverse():
    q = torch.randint(0, 16, (5, 256), dtype=torch.int32)
    packed, sz = vnni.pack(q, torch.rand(5, 2, 2))
    assert packed.shape == (5, 128) and packed.dtype == torch.uint8 and sz.dtype == torch.bfloat16
    assert torch.equal(vnni.unpack(packed), q.to(torch.uint8))
    assert packed[0, 0] == q[0, 0] | q[0, 64] << 4  # byte j: input j low, input j + 64 high


@needs_vnni
@pytest.mark.parametrize("group", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6])
def test_kernel_computes_the_rounded_product(group, rows):
    torch.manual_seed(rows)
    w = (torch.randn(48, 512) * 0.05).to(torch.bfloat16)
    x = torch.randn(rows, 512).to(torch.bfloat16)
    x[0, :64] = 0  # an all-zero block has scale 0
    kernel, packed, sz = quantize(w, "int4", group, kernel="int4-vnni")
    got = quantized_mm(x, kernel, group, packed, sz).double()
    ref = _reference(x, w, group)
    assert got.shape == (rows, 48) and kernel == "int4-vnni"
    assert ((got - ref).norm() / ref.norm()) < 5e-3  # bf16 output and fp32 sums, nothing else
    # the same int4 weights as torch's kernel: the two agree up to the activations' 8-bit rounding
    _, aq, asz = quantize(w, "int4", group, kernel="int4")
    aten = quantized_mm(x, "int4", group, aq, asz).double()
    assert 1e-4 < ((got - aten).norm() / aten.norm()) < 0.02


@needs_vnni
def test_int4_copies_of_bf16_weights_that_fit_take_the_vnni_kernel():
    assert int4_kernel(torch.zeros(16, 256, dtype=torch.bfloat16), 128) == "int4-vnni"
    assert int4_kernel(torch.zeros(16, 256, dtype=torch.bfloat16), 32) == "int4-vnni"
    assert int4_kernel(torch.zeros(16, 576, dtype=torch.bfloat16), 64) == "int4"  # inputs not whole blocks of 128
    assert int4_kernel(torch.zeros(16, 256), 128) == "int4"  # fp32 weights
    lin = torch.nn.Linear(256, 40, bias=True).to(torch.bfloat16)
    low = LowPrecisionLinear(lin, "int4", 128)
    assert low.kernel == "int4-vnni"
    low.active = True
    x = torch.randn(2, 3, 256, dtype=torch.bfloat16)
    ref = lin(x).float()
    assert ((low(x).float() - ref).norm() / ref.norm()) < 0.15
    low.active = False
    assert torch.equal(low(x), lin(x))


def test_the_environment_variable_turns_the_kernel_off(monkeypatch):
    vnni._load.cache_clear()
    monkeypatch.setenv(vnni.ENV, "aten")
    try:
        assert not vnni.available() and vnni.ENV in vnni.unavailable_reason()
        assert int4_kernel(torch.zeros(16, 256, dtype=torch.bfloat16), 128) == "int4"
        with pytest.raises(Exception, match="does not run here"):
            vnni.mm(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(4, 64, dtype=torch.uint8),
                    torch.zeros(4, 1, 2, dtype=torch.bfloat16), 128)
    finally:
        vnni._load.cache_clear()


@needs_vnni
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_greedy_drafts_through_the_vnni_kernel_stay_exact(arch):
    """bf16 models whose widths fit the kernel: the draft's linears and head run on it; the output is AR's."""
    model = tiny_model(arch, dtype=torch.bfloat16, vocab_size=128, hidden_size=128, intermediate_size=256)
    plan = SkipPlan(model.config.num_hidden_layers)
    cfg = DecodeConfig(max_new_tokens=32, k=3, fallback=False)
    ar = autoregressive(model, PROMPT + PROMPT, cfg)
    path = DraftPath(model, plan, DraftOptions(weights="int4", group_size=128, head_weights="int4"), stop_ids=(2,))
    assert path.kernels == ["int4-vnni"]
    sp = self_speculative(model, PROMPT + PROMPT, plan, cfg, draft=path)
    assert sp.tokens == ar.tokens
    assert sp.stats.accepted > 0  # the drafts are the model's own, rounded: most are right
