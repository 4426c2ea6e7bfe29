"""The VNNI int4 kernel (selfspec.kernels.vnni): layout, numbers, choice, and exact drafts through it."""

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft.lowbit import LowPrecisionLinear, int4_kernel, quantize, quantized_mm
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.kernels import reset_kernels, vnni
from selfspec.model.wrap import wrap_descendants
from tests.helpers import PROMPT

needs_vnni = pytest.mark.skipif(not vnni.available(), reason=f"VNNI int4 kernel: {vnni.unavailable_reason()}")


def _reference(x: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """What the kernel computes, in float64: the int4 weights (torch's groups) times the activations rounded to
    int8 per block of 128 inputs (both builds)."""
    kernel, packed, sz = quantize(w, "int4", group, kernel="int4-vnni")
    wd = vnni.dequantize(packed, sz, group)
    return vnni.round_activations(x, vnni.ACT_BLOCK) @ wd.t()


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
@needs_vnni
@pytest.mark.parametrize("rows", [1, 3])
def test_the_mlp_call_rounds_silu_and_its_product_as_the_module_does(rows):
    """The fused MLP call's SiLU (a vectorized polynomial exponential) against torch's, on the same products: the
    activations equal bf16(bf16(silu(gate)) * up) up to a rare last bit, gates far out on both sides included."""
    torch.manual_seed(rows)
    width, inner, group = 128, 384, 128
    h = torch.randn(rows, width).to(torch.bfloat16)
    w = torch.randn(2 * inner, width) * 0.3
    w[:16] *= 30  # gates far out on both sides (tens to hundreds): no exponential overflows
    _, gu, gu_sz = quantize(w.to(torch.bfloat16), "int4", group, kernel="int4-vnni")
    eye = torch.eye(inner, dtype=torch.bfloat16)  # down = identity: the call's output is its activations
    _, down, down_sz = quantize(eye, "int4", group, kernel="int4-vnni")
    ops = vnni._module()
    both = ops.int4_mm(h, gu, gu_sz, group)
    assert both[:, :16].abs().amax() > 80
    act = (torch.nn.functional.silu(both[:, :inner]) * both[:, inner:]).to(torch.bfloat16)
    got = ops.draft_mlp(h, gu, gu_sz, down, down_sz, group)
    want = ops.int4_mm(act, down, down_sz, group)
    assert got.shape == want.shape == (rows, inner) and torch.isfinite(got).all()
    # the same down product of the same activations is bit-identical; an activation one bf16 step off moves a few
    assert (got != want).float().mean() < 0.02
    assert ((got.float() - want.float()).norm() / want.float().norm()) < 1e-2


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
    reset_kernels()
    monkeypatch.setenv(vnni.ENV, "aten")
    try:
        assert not vnni.available() and vnni.ENV in vnni.unavailable_reason()
        assert int4_kernel(torch.zeros(16, 256, dtype=torch.bfloat16), 128) == "int4"
        with pytest.raises(Exception, match="does not run here"):
            vnni.mm(torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(4, 64, dtype=torch.uint8),
                    torch.zeros(4, 1, 2, dtype=torch.bfloat16), 128)
    finally:
        reset_kernels()


@pytest.mark.parametrize("env, flags, reason", [
    ("fbgemm", {"fma", "avx2", "f16c"}, "SELFSPEC_FP16_KERNEL=fbgemm"),
    ("", {"fma", "avx2"}, "the CPU lacks f16c"),
])
def test_the_fp16_kernel_loads_as_the_int4_one(monkeypatch, env, flags, reason):
    """Our fp16 kernel goes through the same loader: its switch, the CPU's flags, nothing built where it cannot run."""
    from selfspec.kernels import fp16

    built = []
    reset_kernels()
    monkeypatch.setenv(fp16.ENV, env)
    monkeypatch.setattr(vnni.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vnni, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(fp16, "build", lambda: built.append(1) or object())
    try:
        assert not fp16.available() and fp16.unavailable_reason() == reason and built == []
        with pytest.raises(RuntimeError, match="does not run here"):
            fp16.linear(torch.zeros(1, 16), torch.zeros(1, 16, 16, dtype=torch.float16), None, 16)
    finally:
        reset_kernels()


@pytest.mark.parametrize("flags, build", [
    ({"fma", "avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512-vnni"),
    ({"fma", "avx2", "avx512f", "avx512bw", "avx512vl"}, "avx2"),  # AVX-512 without VNNI: the AVX2 build
    ({"fma", "avx2"}, "avx2"),
    ({"avx2"}, None),
    (set(), None),
])
def test_the_build_follows_the_cpu_flags(monkeypatch, flags, build):
    """The best build the CPU runs (compiling is replaced: only the choice is under test); none without AVX2 + FMA."""
    built = []
    reset_kernels()
    monkeypatch.delenv(vnni.ENV, raising=False)
    monkeypatch.setattr(vnni.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vnni, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(vnni, "build", lambda name: built.append(name) or object())
    try:
        assert vnni.isa() == build and vnni.available() == (build is not None)
        assert built == ([build] if build else [])
        if build is None:
            assert vnni.unavailable_reason().startswith("the CPU lacks") and "fma" in vnni.unavailable_reason()
        for name in built:  # each build's compiler flags ask for what its CPU flags promise
            needs, cflags = vnni.BUILDS[name]
            assert {f"-m{f.replace('_', '')}" for f in needs} == set(cflags)
    finally:
        reset_kernels()


def test_a_background_build_runs_once_and_callers_wait_for_it(monkeypatch):
    """The search compiles the kernel while it loads the model: a caller during the build waits for its result."""
    import threading

    started, release, built = threading.Event(), threading.Event(), []

    def slow_build(name):
        built.append(name)
        started.set()
        assert release.wait(10)
        return "kernel"

    reset_kernels()
    monkeypatch.delenv(vnni.ENV, raising=False)
    monkeypatch.setattr(vnni.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vnni, "cpu_flags", lambda: {"fma", "avx2"})
    monkeypatch.setattr(vnni, "build", slow_build)
    try:
        thread = vnni.build_in_background()
        assert started.wait(10)
        answers = []
        caller = threading.Thread(target=lambda: answers.append(vnni.isa()))
        caller.start()
        caller.join(0.2)
        assert caller.is_alive() and not answers  # waits on the build in flight instead of starting another
        release.set()
        thread.join(10)
        caller.join(10)
        assert answers == ["avx2"] and built == ["avx2"] and vnni.available()
    finally:
        release.set()
        reset_kernels()


@pytest.mark.parametrize("build, label", [("avx512-vnni", "int4-vnni r7"), ("avx2", "int4-vnni on avx2 r8")])
def test_the_fingerprint_names_the_build_and_its_revision(monkeypatch, build, label):
    """A kernel change that moves its speed is a new revision: studies timed on the old one re-measure their costs
    (revision 1 of the AVX-512 build reads as it always did: "int4-vnni")."""
    from selfspec.draft import fused
    from selfspec.provenance import machine_fingerprint

    assert set(vnni.REVISIONS) == set(vnni.BUILDS)
    monkeypatch.setattr(vnni, "available", lambda: True)
    monkeypatch.setattr(vnni, "isa", lambda: build)
    monkeypatch.setattr(fused, "enabled", lambda: False)
    assert machine_fingerprint()["int4_kernel"] == label
    monkeypatch.setattr(vnni, "REVISIONS", {**vnni.REVISIONS, build: vnni.REVISIONS[build] + 1})
    assert machine_fingerprint()["int4_kernel"] != label


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


def _kernels_for(weights: str) -> str:
    return "int8" if weights == "int8" else "int4-vnni"


@pytest.mark.parametrize("weights", ["int8", pytest.param("int4", marks=needs_vnni)])
def test_siblings_share_one_product_with_the_numbers_they_had_alone(weights, monkeypatch):
    """q/k/v (with biases) and gate/up stack their copies: one product per input, each sibling's output equal
    to what it computes alone, the copies views of the stacked one (no extra memory)."""
    from selfspec.draft import fused, lowbit

    monkeypatch.setenv(fused.ENV, "0")  # the modules' path: fused sublayers call the products inside one operator
    model = tiny_model("qwen2", dtype=torch.bfloat16, vocab_size=128, hidden_size=128, intermediate_size=256)
    plan = SkipPlan(model.config.num_hidden_layers)
    alone = tiny_model("qwen2", dtype=torch.bfloat16, vocab_size=128, hidden_size=128, intermediate_size=256)
    opts = DraftOptions(weights=weights, group_size=128)
    path = DraftPath(model, plan, opts)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.shared is attn.k_proj.shared is attn.v_proj.shared is not None
    assert model.model.layers[0].mlp.gate_proj.shared.members[1] is model.model.layers[0].mlp.up_proj
    assert model.model.layers[0].mlp.down_proj.shared is None and attn.o_proj.shared is None
    key = attn.q_proj.key
    assert key in attn.q_proj.shared.stacked and attn.q_proj.kernel == _kernels_for(weights)
    stacked = attn.q_proj.shared.stacked[key][2]
    assert attn.k_proj.qweight.data_ptr() == stacked[attn.k_proj.rows].data_ptr()  # a view, not a copy
    assert attn.q_proj.bias is not None  # Qwen2's q/k/v carry biases: stacked too

    calls = []
    mm = lowbit.quantized_mm
    monkeypatch.setattr(lowbit, "quantized_mm", lambda *a: calls.append(a[0].shape) or mm(*a))
    ids = torch.tensor([PROMPT])
    with torch.no_grad(), path.drafting():
        got = model(ids).logits
    layers = model.config.num_hidden_layers
    assert len(calls) == 4 * layers  # q/k/v, o, gate/up, down: not 7 per layer
    # the same weights through wrappers that never stacked: each linear its own product
    single = wrap_descendants(alone.model.layers, LowPrecisionLinear,
                              match=lambda m: isinstance(m, torch.nn.Linear),
                              make=lambda m: LowPrecisionLinear(m, weights, 128))
    for lin in single:
        lin.active = True
    with torch.no_grad():
        ref = alone(ids).logits
    assert all(lin.shared is None for lin in single)
    assert torch.equal(got, ref)


@needs_vnni
def test_each_int4_copy_moves_onto_huge_pages_once_where_it_ends_up(monkeypatch):
    """Siblings' copies are stacked: the stacked copy is placed, not the copies it was made of; an unstacked
    linear's copy is placed once; a second format places its own copies only."""
    from selfspec.draft.lowbit import wrap_linears
    from selfspec.kernels import hugepages

    placed = []
    monkeypatch.setattr(hugepages, "advise", lambda t: placed.append(t.untyped_storage().data_ptr()) or 0)
    model = tiny_model("qwen2", dtype=torch.bfloat16, vocab_size=128, hidden_size=128, intermediate_size=256)
    layer = model.model.layers[0]
    wrap_linears(layer, "int4", 128)
    attn, mlp = layer.self_attn, layer.mlp

    def final(key):  # the storage each copy in use lives in: the stacked ones, and o / down's own
        return sorted({lin.copy(*key)[1].untyped_storage().data_ptr()
                       for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                                   mlp.down_proj)})

    assert len(final(("int4", 128))) == 4 and sorted(placed) == final(("int4", 128))
    placed.clear()
    wrap_linears(layer, "int4", 128)  # the same format again: nothing new to place
    assert placed == []
    wrap_linears(layer, "int4", 32)
    assert sorted(placed) == final(("int4", 32))


def test_a_shared_input_changed_in_place_is_computed_again():
    from selfspec.draft.lowbit import SharedInput

    a, b = (LowPrecisionLinear(torch.nn.Linear(64, 8, bias=False), "int8", 0) for _ in range(2))
    shared = SharedInput([a, b])
    shared.stack(a.key)
    a.active = b.active = True
    x = torch.randn(1, 64)
    ya = a(x)
    y = shared.y
    yb = b(x)
    assert shared.y is y  # b read a's product
    for lin, out in ((a, ya), (b, yb)):  # each its own rows, as computed alone
        kernel, q, scale = lin.copy("int8", 0)
        assert torch.equal(out, quantized_mm(x, kernel, 0, q, scale))
    x.mul_(2)  # outside inference mode the version counter tells the in-place change
    yb2 = b(x)
    assert shared.y is not y
    kernel, q, scale = b.copy("int8", 0)
    assert torch.equal(yb2, quantized_mm(x, kernel, 0, q, scale))
    shared.forget()
    assert shared.x is None and shared.y is None


def test_plain_attributes_are_set_without_module_checks_but_never_over_parameters():
    from selfspec.model.wrap import set_plain

    lin = torch.nn.Linear(4, 4)
    set_plain(lin, active=True)
    assert lin.active is True
    with pytest.raises(AttributeError, match="parameter"):
        set_plain(lin, weight=torch.zeros(4, 4))


@pytest.mark.cli
def test_a_build_stopped_midway_leaves_no_lock_that_blocks_the_next(tmp_path, monkeypatch, capsys):
    """torch's build guards its folder with a `lock` file; a process killed mid-build leaves it behind, and the next
    build must not wait on it forever (ours holds an flock, which the OS drops with the process)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch.utils.cpp_extension as ext

    killed_mid_build = (
        "import os, pathlib, signal\n"
        "import torch.utils.cpp_extension as ext\n"
        "def stop(name, sources, build_directory, **kw):\n"
        "    pathlib.Path(build_directory, 'lock').write_text('')  # torch's baton, then the process dies\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "ext.load = stop\n"
        "from selfspec.kernels import vnni\n"
        "vnni.compile_extension(vnni.SOURCE, 'int4_vnni-test', [])\n")
    p = subprocess.run([sys.executable, "-c", killed_mid_build], env={**os.environ, "SELFSPEC_CACHE": str(tmp_path)},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr[-2000:]
    (left,) = tmp_path.glob("kernels/int4_vnni-test-*/lock")
    seen = []
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(ext, "load", lambda name, sources, build_directory, **kw:
                        seen.append(Path(build_directory, "lock").exists()))
    vnni.compile_extension(vnni.SOURCE, "int4_vnni-test", [])
    assert seen == [False] and not left.exists()
    assert "removed a stale build lock" in capsys.readouterr().err
