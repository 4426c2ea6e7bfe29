"""Prepacked bf16 weights: the same numbers and tokens as the stock linears, used only inside the block.

Tests that pack run where oneDNN can pack bf16 (AVX-512 or AVX-NE-CONVERT); the fallback to the stock
kernels is tested everywhere, by telling the code that this CPU cannot pack.
"""

from dataclasses import replace

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.models import LoadedModel
from selfspec.assets.tiny import tiny_model
from selfspec.draft.lowbit import LowPrecisionLinear
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.errors import SelfSpecError
from selfspec.eval.methods import build_method
from selfspec.kernels import packed as packed_module
from selfspec.kernels import reset_kernels
from selfspec.kernels.packed import PackedLinear, packing_supported, weight_packer
from tests.helpers import CONF, PROMPT

needs_packing = pytest.mark.skipif(not packing_supported(), reason="this CPU's oneDNN cannot prepack bf16 weights "
                                   "(that needs AVX-512 bw/vl/dq or AVX-NE-CONVERT)")

PLAN = SkipPlan(4, attn=(1,), mlp=(2,))


def _bf16(arch="qwen2"):
    return tiny_model(arch, dtype=torch.bfloat16, vocab_size=96)  # fresh: packing wraps modules in place


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_packed_logits_are_bit_identical_and_only_inside_the_block(arch):
    model = _bf16(arch)
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(input_ids=x).logits
        packer = weight_packer(model)
        with packer.packed():
            assert all(lin.active for lin in packer.linears)
            inside = model(input_ids=x).logits
        after = model(input_ids=x).logits
    assert not any(lin.active for lin in packer.linears)
    n_linear = sum(isinstance(m, PackedLinear) for m in model.modules())
    assert n_linear == len(packer.linears) > 4 * 4  # every projection of 4 layers, and the head
    assert packer.extra_bytes == sum(lin.weight.numel() * 2 for lin in packer.linears)
    assert torch.equal(before, after)
    assert torch.equal(before, inside)


@needs_packing
def test_packed_blocks_nest_and_switch_off_on_error():
    packer = weight_packer(_bf16())
    with pytest.raises(ValueError):
        with packer.packed():
            with packer.packed():
                pass
            assert all(lin.active for lin in packer.linears)  # the inner block did not switch them off
            raise ValueError
    assert not any(lin.active for lin in packer.linears)


@needs_packing
def test_autoregressive_tokens_do_not_depend_on_packing():
    model = _bf16()
    cfg = DecodeConfig(max_new_tokens=40)
    plain = autoregressive(model, PROMPT, replace(cfg, packed_weights=False))
    assert model.__dict__.get("_selfspec_packer") is None  # nothing packed when not asked for
    packed = autoregressive(model, PROMPT, cfg)
    assert packed.tokens == plain.tokens and len(packed.tokens) == 40
    assert weight_packer(model).linears


def test_fp32_weights_are_left_as_loaded():
    model = tiny_model("qwen2", vocab_size=96)
    packer = weight_packer(model)
    assert packer.linears == [] and packer.extra_bytes == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@needs_packing
@pytest.mark.parametrize("pack_first", [True, False])
def test_draft_copies_wrap_the_packed_linears_in_either_order(pack_first):
    model = _bf16()
    if pack_first:
        weight_packer(model)
    path = DraftPath(model, PLAN, DraftOptions(weights="int8", head_tokens=40), stop_ids=(2,))
    packer = weight_packer(model)
    assert path.linears and all(isinstance(lin.inner, PackedLinear) for lin in path.linears)
    assert not any(isinstance(m.inner, LowPrecisionLinear) for m in packer.linears)
    x = torch.tensor([PROMPT])
    path.prepare(x)
    with torch.inference_mode():
        with path.drafting():
            draft_plain = model(input_ids=x).logits
        with packer.packed(), path.drafting():
            draft_packed = model(input_ids=x).logits  # the int8 copies win over the packed bf16 weights
    assert torch.equal(draft_plain, draft_packed)
    cfg = DecodeConfig(max_new_tokens=40, k=3, fallback=False)
    ar = autoregressive(model, PROMPT + PROMPT, cfg)
    sp = self_speculative(model, PROMPT + PROMPT, PLAN, cfg, draft=path)
    assert sp.tokens == ar.tokens


@needs_packing
def test_methods_report_the_packed_copies_as_extra_memory():
    model = _bf16()
    lm = LoadedModel(name="tiny", model=model, tokenizer=None, eos_ids=frozenset({2}), source="tiny", info={})
    off = build_method("autoregressive", lm, DecodeConfig(max_new_tokens=4, packed_weights=False))
    assert off.extra_memory_bytes == 0
    on = build_method("autoregressive", lm, DecodeConfig(max_new_tokens=4))
    assert on.extra_memory_bytes == weight_packer(model).extra_bytes > 0
    spec = build_method("self_speculative", lm, DecodeConfig(max_new_tokens=4), PLAN, {"weights": "int8"})
    assert spec.extra_memory_bytes > on.extra_memory_bytes


def _dense_weights(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@needs_packing
def test_packed_only_frees_the_dense_weights_and_computes_the_same():
    model = _bf16()
    dense = _dense_weights(model)
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(input_ids=x).logits
        packer = weight_packer(model, keep_dense=False)
        outside = model(input_ids=x).logits  # no dense weight left to compute on: packed everywhere
        with packer.packed():
            inside = model(input_ids=x).logits
    assert torch.equal(before, outside) and torch.equal(before, inside)
    head = model.get_output_embeddings()
    freed = [lin for lin in packer.linears if lin is not head]
    assert freed and all(not lin.dense and "weight" not in dict(lin.inner.named_parameters()) for lin in freed)
    assert head.dense and head.pinned  # the draft's cut head gathers its rows
    assert packer.extra_bytes == head.weight.numel() * 2
    assert sum(p.numel() for p in model.parameters()) < sum(t.numel() for t in dense.values())
    packer.keep_dense(True)  # rebuilt exactly from the packed copies
    restored = {n.replace(".inner", ""): p for n, p in model.named_parameters()}
    assert restored.keys() == dense.keys()
    assert all(torch.equal(restored[n], dense[n]) for n in dense)
    assert packer.extra_bytes == sum(lin.weight.numel() * 2 for lin in packer.linears)


@needs_packing
def test_packed_only_keeps_a_tied_weight_dense():
    model = tiny_model("qwen2", dtype=torch.bfloat16, vocab_size=96, tie_embeddings=True)
    packer = weight_packer(model, keep_dense=False)
    head = model.get_output_embeddings()
    assert head.pinned and head.dense and head.weight is model.get_input_embeddings().weight
    assert all(not lin.dense for lin in packer.linears if lin is not head)


@needs_packing
def test_draft_built_on_freed_weights_equals_the_draft_built_on_dense_ones():
    x = torch.tensor([PROMPT])
    logits = []
    for free_first in (False, True):
        model = _bf16()
        if free_first:
            weight_packer(model, keep_dense=False)
        path = DraftPath(model, PLAN, DraftOptions(weights="int4", head_tokens=40), stop_ids=(2,))
        path.prepare(x)
        with torch.inference_mode(), path.drafting():
            logits.append(model(input_ids=x).logits)
    assert torch.equal(logits[0], logits[1])


@needs_packing
def test_packed_only_decodes_the_same_tokens_and_reports_no_copies():
    model = _bf16()
    lm = LoadedModel(name="tiny", model=model, tokenizer=None, eos_ids=frozenset({2}), source="tiny", info={})
    cfg = DecodeConfig(max_new_tokens=40, k=3, fallback=False)
    plain = autoregressive(model, PROMPT + PROMPT, replace(cfg, packed_weights=False))
    only = replace(cfg, packed_only=True)
    ar = build_method("autoregressive", lm, only)
    spec = build_method("self_speculative", lm, only, PLAN, {"weights": "int8"})
    head = model.get_output_embeddings()
    assert ar.extra_memory_bytes == head.weight.numel() * 2  # only the LM head keeps a dense copy
    assert spec.extra_memory_bytes > ar.extra_memory_bytes
    assert ar.generate(PROMPT + PROMPT).tokens == plain.tokens
    assert spec.generate(PROMPT + PROMPT).tokens == plain.tokens
    with pytest.raises(SelfSpecError, match="packed_only"):
        build_method("hf_generate", lm, only)
    assert autoregressive(model, PROMPT + PROMPT, replace(cfg, packed_weights=False)).tokens == plain.tokens
    assert weight_packer(model).keeps_dense  # decoding unpacked rebuilt the dense weights


def test_packed_only_needs_packed_weights():
    with pytest.raises(SelfSpecError, match="packed_weights"):
        DecodeConfig(packed_weights=False, packed_only=True)


def _as_on_a_cpu_that_packs(monkeypatch, fmt):
    """Tell the code that this CPU cannot pack bf16 weights and packs them as ``fmt`` (None: not at all)."""
    from selfspec.eval import records

    monkeypatch.setattr(packed_module, "packing_supported", lambda: False)
    for module in (packed_module, records):
        monkeypatch.setattr(module, "pack_format", lambda: fmt)
    reset_kernels()  # the notice of the kernels that run is said again


def test_a_cpu_that_cannot_pack_bf16_runs_every_method_on_the_stock_kernels(monkeypatch, capsys):
    from selfspec.eval import records

    _as_on_a_cpu_that_packs(monkeypatch, None)
    model = _bf16()
    lm = LoadedModel(name="tiny", model=model, tokenizer=None, eos_ids=frozenset({2}), source="tiny", info={})
    cfg = DecodeConfig(max_new_tokens=24, k=3, fallback=False)
    ar = build_method("autoregressive", lm, cfg)
    assert weight_packer(model).linears == [] and ar.extra_memory_bytes == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert "cannot prepack bf16" in capsys.readouterr().err  # said once, on stderr
    spec = build_method("self_speculative", lm, cfg, PLAN, {"weights": "int4"})
    plain = autoregressive(model, PROMPT + PROMPT, replace(cfg, packed_weights=False))
    assert ar.generate(PROMPT + PROMPT).tokens == plain.tokens == spec.generate(PROMPT + PROMPT).tokens
    assert "packed_weights" not in records.decode_record(cfg)  # recorded as it ran: on the weights as loaded
    assert packed_module.kernels_label(True) == "stock" and packed_module.kernels_label(False) == "stock"


@pytest.fixture
def bf16_packing(monkeypatch):
    """The full model packed for oneDNN in bf16, as on a CPU with AVX-512 and no AMX."""
    monkeypatch.setenv(packed_module.PACK_ENV, "bf16")
    packed_module.pack_format.cache_clear()
    yield
    monkeypatch.delenv(packed_module.PACK_ENV)
    packed_module.pack_format.cache_clear()


AMX = {"avx512f", "amx_tile", "amx_bf16"}


@pytest.mark.parametrize("flags, runs, asked, want", [
    ({"avx512f"}, False, "", "bf16"), (AMX, True, "", "amx"), (AMX, False, "", "fp16"), (AMX, True, "bf16", "bf16"),
    ({"avx512f", "avx512_bf16"}, True, "", "amx"), ({"avx512f", "avx512_bf16"}, False, "", "bf16"),
    (AMX, True, "fp16", "fp16"), ({"avx512f"}, False, "fp16", "fp16"), ({"avx512f"}, True, "amx", "amx")])
def test_a_cpu_with_amx_packs_the_full_model_for_our_amx_kernel_where_it_runs(monkeypatch, flags, runs, asked, want):
    """Our bf16 panels where the kernel runs (AMX tiles or AVX-512 BF16; else the fp16 panels on AMX, oneDNN without);
    whatever the CPU, what SELFSPEC_PACK asks for."""
    from selfspec.kernels import amx, vnni

    monkeypatch.setattr(packed_module, "packing_supported", lambda: True)
    monkeypatch.setattr(vnni, "cpu_flags", lambda: flags)
    monkeypatch.setattr(amx, "available", lambda: runs)
    monkeypatch.setattr(amx, "unavailable_reason", lambda: None if runs else "the CPU lacks amx_tile")
    monkeypatch.setenv(packed_module.PACK_ENV, asked)
    packed_module.pack_format.cache_clear()
    try:
        assert packed_module.pack_format() == want
        assert (packed_module.pack_label() == amx.label()) == (want == "amx")
        assert packed_module.kernels_label(True, "amx") == f"packed {amx.label()}"  # asked for, whatever the CPU's
        assert packed_module.kernels_label(True, "fp32") == "packed fp32" and packed_module.kernels_label(False) == "stock"
        monkeypatch.setenv(packed_module.PACK_ENV, "int4")
        packed_module.pack_format.cache_clear()
        with pytest.raises(SelfSpecError, match="SELFSPEC_PACK=int4: bf16"):
            packed_module.pack_format()
        if not runs:  # asked for where it does not run: said, not swapped for another kernel
            monkeypatch.setenv(packed_module.PACK_ENV, "amx")
            packed_module.pack_format.cache_clear()
            with pytest.raises(SelfSpecError, match="SELFSPEC_PACK=amx: our AMX kernel does not run here"):
                packed_module.pack_format()
    finally:
        monkeypatch.delenv(packed_module.PACK_ENV)
        packed_module.pack_format.cache_clear()


@needs_packing
def test_a_cpu_that_packs_bf16_records_the_packed_kernels(bf16_packing):
    from selfspec.eval.records import decode_record

    assert decode_record(DecodeConfig())["packed_weights"] is True
    assert packed_module.kernels_label(True) == "packed" and packed_module.kernels_label(False) == "stock"


def test_where_bf16_cannot_be_packed_forwards_of_three_rows_or_more_run_on_fp32_copies(monkeypatch, capsys):
    from selfspec.eval import records

    _as_on_a_cpu_that_packs(monkeypatch, "fp32")
    model = _bf16()
    dense = _dense_weights(model)
    packer = weight_packer(model)
    assert "fp32 copies" in capsys.readouterr().err
    assert packer.linears and all(lin.kind == "fp32" for lin in packer.linears)
    assert packer.extra_bytes == sum(lin.weight.numel() * 4 for lin in packer.linears)  # fp32: twice the bf16 bytes
    lin = packer.linears[0]
    with torch.inference_mode():
        for rows in (1, 2, 3, 7):
            x = torch.randn(1, rows, lin.in_features, dtype=torch.bfloat16)
            stock = lin.inner(x)
            with packer.packed():
                got = lin(x)
            assert got.dtype == torch.bfloat16 and got.shape == stock.shape
            if rows < packed_module.FP32_MIN_ROWS:
                assert torch.equal(got, stock)  # the stock bf16 kernel
            else:  # the bf16 values in fp32, rounded back: the same numbers up to the order of the sums
                want = torch.nn.functional.linear(x.float(), lin.inner.weight.float()).to(torch.bfloat16)
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    cfg = DecodeConfig(max_new_tokens=24, k=3, fallback=False)
    assert autoregressive(model, PROMPT, replace(cfg, rows=1)).tokens == \
        autoregressive(model, PROMPT, replace(cfg, rows=1, packed_weights=False)).tokens  # one-row steps: stock
    assert records.decode_record(cfg)["packed_weights"] == "fp32"
    assert packed_module.kernels_label(True) == "packed fp32"
    packer.keep_dense(False)  # the bf16 weights rebuilt from the fp32 copies are exact
    packer.keep_dense(True)
    restored = {n.replace(".inner", ""): p for n, p in model.named_parameters()}
    assert all(torch.equal(restored[n], dense[n]) and restored[n].dtype == torch.bfloat16 for n in dense)


@pytest.mark.skipif(not packed_module.fbgemm_fp16(), reason="no fbgemm fp16 kernel in this torch build")
@pytest.mark.parametrize("kernel", ["fbgemm", "panels"])
def test_where_bf16_cannot_be_packed_but_fbgemm_runs_every_forward_uses_exact_fp16_copies(monkeypatch, capsys, kernel):
    from selfspec.eval import records
    from selfspec.kernels import fp16
    from selfspec.provenance import machine_fingerprint

    if kernel == "panels" and not fp16.available():
        pytest.skip(f"our fp16 kernel does not run here: {fp16.unavailable_reason()}")
    _as_on_a_cpu_that_packs(monkeypatch, "fp16")
    if kernel == "fbgemm":
        monkeypatch.setattr(packed_module, "fp16_kernel", lambda: "fbgemm")
    label = "fp16" if kernel == "fbgemm" else f"fp16 {fp16.label()}"
    model = _bf16()
    with torch.no_grad():  # one weight fp16 cannot hold (2**-20 lies below its subnormals' bf16-exact range)
        model.model.layers[0].mlp.down_proj.weight[0, 0] = 2.0 ** -20 * 1.0078125
    dense = _dense_weights(model)
    packer = weight_packer(model)
    assert "fp16 copies" in capsys.readouterr().err
    other = "fp32" if kernel == "fbgemm" else "bf16 panels"  # where a weight does not fit fp16
    assert model.model.layers[0].mlp.down_proj.kind == other  # the weight that does not fit
    assert all(lin.panels == (kernel == "panels") for lin in packer.linears)  # our kernel takes every weight
    for lin in packer.linears:  # fp16 exactly where it holds the weight (a random init may have other tiny values)
        w = lin.inner.weight.float()
        assert lin.kind == ("fp16" if torch.equal(w.half().float(), w) else other)
        if lin.panels:
            assert lin.packed.dtype == (torch.float16 if lin.kind == "fp16" else torch.bfloat16)
    assert sum(lin.kind == "fp16" for lin in packer.linears) > len(packer.linears) // 2
    assert packer.extra_bytes == sum(  # our panels pad the outputs to a multiple of 16
        (-(-lin.out_features // 16) * 16 if lin.panels else lin.out_features) * lin.in_features
        * (4 if lin.kind == "fp32" else 2) for lin in packer.linears)
    with torch.inference_mode():
        for lin in packer.linears[:3]:
            for rows in (1, 2, 7, 13):
                x = torch.randn(1, rows, lin.in_features, dtype=torch.bfloat16)
                with packer.packed():
                    got = lin(x)
                assert got.dtype == torch.bfloat16 and got.shape == (1, rows, lin.out_features)
                want = torch.nn.functional.linear(x.float(), lin.inner.weight.float(),
                                                  None if lin.bias is None else lin.bias.float()).to(torch.bfloat16)
                torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)  # up to the order of the sums
    cfg = DecodeConfig(max_new_tokens=24, k=3, fallback=False)
    assert len(autoregressive(model, PROMPT, cfg).tokens) == 24
    assert records.decode_record(cfg)["packed_weights"] == label  # runs on the two fp16 kernels never mix
    assert packed_module.kernels_label(True) == f"packed {label}" and DecodeConfig().rows == 1
    assert machine_fingerprint()["kernels"] == label  # a study timed on other kernels re-measures its costs
    packer.keep_dense(False)  # the bf16 weights rebuilt from the fp16 (and fp32) copies are exact
    packer.keep_dense(True)
    restored = {n.replace(".inner", ""): p for n, p in model.named_parameters()}
    assert all(torch.equal(restored[n], dense[n]) and restored[n].dtype == torch.bfloat16 for n in dense)


@pytest.mark.parametrize("fmt, rows", [("bf16", 6), ("fp16", 1), ("fp32", 1), (None, 1)])
def test_the_padded_width_defaults_to_the_cpus(monkeypatch, fmt, rows):
    """bf16: a CPU whose one-row products differ from wider ones (the Zen 4; test_widths.py has the other case)."""
    from omegaconf import OmegaConf

    from selfspec.cli.config import decode_config
    from selfspec.kernels import widths

    monkeypatch.setattr(packed_module, "pack_format", lambda: fmt)
    monkeypatch.setattr(widths, "one_row_exact", lambda: False)
    assert DecodeConfig().rows == rows
    cfg = OmegaConf.load(CONF / "decoding" / "default.yaml")
    assert cfg.rows is None  # the config leaves it to the CPU
    assert decode_config(OmegaConf.create({"decoding": cfg}), 16, None).rows == rows
    cfg.rows = 4
    assert decode_config(OmegaConf.create({"decoding": cfg}), 16, None).rows == 4


@needs_packing
def test_a_model_packed_as_fp16_on_a_cpu_that_packs_bf16_computes_on_our_panels_beside_one_on_onednn():
    from selfspec.kernels import fp16

    if not fp16.available():
        pytest.skip(f"our fp16 kernel does not run here: {fp16.unavailable_reason()}")
    onednn, panels = _bf16(), _bf16()
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        want = onednn(input_ids=x).logits
        packers = weight_packer(onednn, kind="bf16"), weight_packer(panels, kind="fp16")
        assert {lin.kind for lin in packers[0].linears} == {"bf16"}
        assert all(lin.panels and lin.kind in ("fp16", "bf16 panels") for lin in packers[1].linears)
        with packers[1].packed():
            got = panels(input_ids=x).logits
    torch.testing.assert_close(got.float(), want.float(), rtol=3e-2, atol=3e-2)  # up to the order of the sums
    assert weight_packer(panels, kind="fp16") is packers[1] and weight_packer(panels) is packers[1]
    assert (packers[0].kind, packers[1].kind) == ("bf16", "fp16")
    default = _bf16()  # packed as this CPU packs: asking for that packing again is no conflict
    assert weight_packer(default, kind=packed_module.pack_format()) is weight_packer(default)
    with pytest.raises(ValueError, match="packed as fp16, not bf16"):
        weight_packer(panels, kind="bf16")
    with pytest.raises(ValueError, match="packed kind 'int4'"):
        PackedLinear(torch.nn.Linear(8, 8).to(torch.bfloat16), kind="int4")


@needs_packing
def test_fp16_panels_where_onednn_packs_bf16_leave_a_prefill_s_rows_to_the_stock_kernel():
    from selfspec.kernels import fp16

    if not fp16.available():
        pytest.skip(f"our fp16 kernel does not run here: {fp16.unavailable_reason()}")
    torch.manual_seed(0)
    lin = PackedLinear(torch.nn.Linear(64, 40).to(torch.bfloat16), kind="fp16")
    assert lin.panels and lin.stock_from == packed_module.PREFILL_MIN_ROWS["fp16"]
    lin.active = True
    with torch.inference_mode():
        wide = torch.randn(lin.stock_from, 64, dtype=torch.bfloat16)
        assert torch.equal(lin(wide), lin.inner(wide))  # the stock kernel's bits
        narrow = wide[:lin.stock_from - 1]  # a verify's rows: each as a one-row step computes it
        got = lin(narrow)
        assert all(torch.equal(got[i:i + 1], lin(narrow[i:i + 1])) for i in range(0, len(narrow), 7))
        lin.drop_dense()
        assert torch.equal(lin(wide)[:5], lin(wide[:5]))  # without the dense weight: the panels, every row alike
