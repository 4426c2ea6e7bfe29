"""The int4 groups' fit: least squares never errs more than the even span of a group's range, costs the same bytes,
and a draft fitted that way keeps greedy output exact beside one fitted the other way on the same model."""

from dataclasses import replace

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft.lowbit import _int4_groups, copy_key
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.errors import SelfSpecError
from tests.helpers import PROMPT


def _error(w: torch.Tensor, group: int, fit: str) -> torch.Tensor:
    """Each group's squared error of the fit (before the scale and zero are stored in bf16)."""
    q, scale, zero = _int4_groups(w, group, fit)
    n, k = w.shape
    deq = (q.float().reshape(n, k // group, group) - 8) * scale[..., None] + zero[..., None]
    return ((deq - w.float().reshape(n, k // group, group)) ** 2).sum(-1)


@pytest.mark.parametrize("group", [32, 128])
def test_the_least_squares_fit_errs_no_more_than_min_max_in_any_group(group):
    torch.manual_seed(0)
    w = torch.cat([torch.randn(300, 256), torch.randn(20, 256) ** 3, torch.zeros(4, 256)]).bfloat16()  # odd shapes
    minmax, lsq = _error(w, group, "minmax"), _error(w, group, "lsq")
    assert (lsq <= minmax * (1 + 1e-6) + 1e-12).all()
    assert lsq.sum() < 0.95 * minmax.sum()  # and less over a Gaussian matrix as a whole
    q, scale, _ = _int4_groups(w, group, "lsq")
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15 and (scale > 0).all()
    assert torch.equal(_int4_groups(w, group, "lsq")[0], q)  # deterministic
    assert _int4_groups(w[:, :group], group, "lsq")[0].shape == (w.shape[0], group)
    with pytest.raises(SelfSpecError, match="fit"):
        _int4_groups(w, group, "gptq")


@pytest.mark.parametrize("fit, levels", [("lsq3", 8), ("lsq2", 4)])
def test_fewer_level_fits_use_that_many_values_and_err_more_the_fewer_they_are(fit, levels):
    torch.manual_seed(0)
    w = torch.randn(64, 256).bfloat16()
    q, scale, _ = _int4_groups(w, 32, fit)
    assert int(q.min()) == 0 and int(q.max()) == levels - 1 and (scale > 0).all()
    per_group = q.reshape(64, 8, 32)
    assert all(len(g.unique()) <= levels for g in per_group.reshape(-1, 32))
    err, lsq = _error(w, 32, fit).sum(), _error(w, 32, "lsq").sum()
    assert err > 2 * lsq  # half the levels: about four times the squared error of an even grid
    if levels == 4:
        assert err > 2 * _error(w, 32, "lsq3").sum()


def test_a_quantized_head_keeps_16_levels_where_the_layers_take_fewer():
    model = tiny_model("llama", seed=3)
    path = DraftPath(model, SkipPlan(model.config.num_hidden_layers),
                     DraftOptions(weights="int4", head_weights="int4", int4_fit="lsq3"))
    fewer = DraftPath(model, SkipPlan(model.config.num_hidden_layers),
                      DraftOptions(weights="int4", head_weights="int4", int4_fit="lsq"))
    assert torch.equal(path.head_low[3], fewer.head_low[3])  # the same head copy as the 16-level fit's
    lin = path.linears[0]  # one wrapper of the model's linear, holding both copies
    assert not torch.equal(lin.copy("int4", 32, "lsq3")[1], lin.copy("int4", 32, "lsq")[1])


def _four_bit_blocks(n: int, k: int, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 weight dequantized from 4-bit blocks as a GGUF Q4_K tensor is (value = step * q - offset, q in
    0..15, levels drawn unevenly so that most blocks miss some), and its levels q."""
    torch.manual_seed(1)
    q = torch.randint(0, 16, (n, k // block, block)).float()
    q = torch.where(torch.rand(n, k // block, 1) < 0.5, (q * 0.6).round() + 3, q)  # half the blocks span 3..12
    step = torch.rand(n, k // block, 1) * 0.02 + 0.001
    offset = step * (torch.rand(n, k // block, 1) * 16)
    return (q * step - offset).reshape(n, k).bfloat16(), q.reshape(n, k)


def test_the_grid_fit_gives_a_4_bit_checkpoint_its_own_values_back_and_errs_no_more_than_lsq():
    w, q = _four_bit_blocks(64, 256)
    grid, lsq, minmax = (_error(w, 32, fit) for fit in ("grid", "lsq", "minmax"))
    assert (grid <= lsq * (1 + 1e-6) + 1e-12).all()
    scale = w.float().reshape(64, 8, 32).pow(2).sum(-1)
    assert (grid / scale).max() < 1e-5 < (minmax / scale).median()  # only the values' bf16 rounding is left
    got, _, _ = _int4_groups(w, 32, "grid")
    span = q.reshape(64, 8, 32)
    span = span - span.amin(-1, keepdim=True)
    assert torch.equal(got.reshape(64, 8, 32).float(), span)  # the same levels, counted from the block's lowest
    # groups of 64 hold two blocks of other steps: not one grid, so the lsq fit (the same numbers)
    assert torch.equal(_error(w, 64, "grid"), _error(w, 64, "lsq"))
    gauss = torch.randn(40, 128).bfloat16()  # no grid in it: the lsq fit
    assert torch.equal(_int4_groups(gauss, 32, "grid")[0], _int4_groups(gauss, 32, "lsq")[0])
    flat = torch.full((4, 64), 0.5).bfloat16()  # one level per group
    assert (_error(flat, 32, "grid") < 1e-12).all()


def test_a_least_squares_draft_beside_a_min_max_one_stays_exact_and_keeps_its_own_copies():
    model = tiny_model("qwen2", vocab_size=96)
    plan, prompt = SkipPlan(4, attn=(1,)), PROMPT + PROMPT
    cfg = DecodeConfig(max_new_tokens=32, k=3, fallback=False)
    ar = autoregressive(model, prompt, cfg).tokens
    fits = {fit: DraftOptions(weights="int4", group_size=32, head_weights="int4", int4_fit=fit) for fit in ("minmax", "lsq")}
    paths = {fit: DraftPath(model, plan, o, stop_ids=(2,)) for fit, o in fits.items()}
    for fit in ("lsq", "minmax", "lsq"):
        assert self_speculative(model, prompt, plan, cfg, draft=paths[fit]).tokens == ar
    lin = paths["lsq"].linears[0]
    low, fitted = lin.copy("int4", 32), lin.copy("int4", 32, "lsq")
    assert copy_key("int4", 32, "lsq") in lin.copies and copy_key("int4", 32) in lin.copies
    assert not torch.equal(low[2], fitted[2])  # other scales, the same layout and bytes
    assert low[1].shape == fitted[1].shape and paths["lsq"].extra_bytes == paths["minmax"].extra_bytes
    assert paths["lsq"].head_low is not paths["minmax"].head_low
    spec = DraftSpec(plan, fits["lsq"], k=3)
    assert DraftSpec.from_dict(spec.to_dict()).options.int4_fit == "lsq" and "g32 lsq" in spec.describe()
    assert "g32 grid" in DraftSpec(plan, replace(fits["lsq"], int4_fit="grid"), k=3).describe()
    assert spec.key != DraftSpec(plan, fits["minmax"], k=3).key
    assert "int4_fit" not in fits["minmax"].record() and fits["lsq"].record()["int4_fit"] == "lsq"
    with pytest.raises(SelfSpecError, match="int4_fit"):
        DraftOptions(weights="int4", int4_fit="best")


def test_the_search_can_search_the_fit_and_its_simulator_keeps_the_fits_apart():
    from selfspec.search.rounds import forward_key
    from selfspec.search.simulate import RoundSimulator
    from selfspec.search.space import DraftDims, SearchSpace

    space = SearchSpace(4, dims=DraftDims(weights=("model", "int4"), group_size=(32,), int4_fit=("minmax", "lsq")))
    fitted = DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(weights="int4", group_size=32, int4_fit="lsq"), k=3)
    assert space.spec_of(space.params_of(fitted)) == fitted and space.describe()["dims"]["int4_fit"] == ["minmax", "lsq"]
    assert "int4_fit" not in SearchSpace(4).describe()["dims"]  # studies made before it resume
    plain = space.spec_of({**space.params_of(fitted), "weights": "model"})
    assert plain.options.int4_fit == "minmax"  # no int4 copy, nothing to fit: one draft, not two
    with pytest.raises(SelfSpecError, match="int4_fit"):
        DraftDims(int4_fit=("minmax", "awq"))
    even = fitted.replace(options=DraftOptions(weights="int4", group_size=32))
    assert forward_key(even) != forward_key(fitted)
    model = tiny_model("qwen2", vocab_size=96)
    prompts = [PROMPT, PROMPT + PROMPT]
    conts = [autoregressive(model, p, DecodeConfig(max_new_tokens=20)).tokens for p in prompts]
    shared = RoundSimulator(model, prompts, conts)
    shared.simulate(even)
    assert shared.simulate(fitted) == RoundSimulator(model, prompts, conts).simulate(fitted)
    assert len(shared.memo) == 2  # a forward of each fit
