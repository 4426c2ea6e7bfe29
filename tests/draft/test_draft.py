"""The cheaper draft path: transparent outside drafting, exact output, quantized kernels, copy drafting."""

import pytest
import torch

from selfspec import (
    DecodeConfig,
    SelfSpecError,
    SkipPlan,
    autoregressive,
    self_speculative,
)
from selfspec.assets.tiny import tiny_model
from selfspec.draft.copy import NGramIndex
from selfspec.draft.lowbit import LowPrecisionLinear
from selfspec.draft.path import DraftOptions, DraftPath
from tests.helpers import PROMPT

PLAN = SkipPlan(4, attn=(1,), mlp=(2,))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("options", [
    DraftOptions(weights="int8"),
    DraftOptions(head_tokens=40),
    DraftOptions(ngram=2),
    DraftOptions(ngram=3, min_ngram=1),
    DraftOptions(weights="int8", head_tokens=40, ngram=1),
    DraftOptions(weights="int4", head_tokens=40, head_weights="int4"),
    DraftOptions(head_weights="int8"),
])
def test_greedy_output_is_exact_with_every_draft_option(arch, options):
    model = tiny_model(arch, vocab_size=96)  # a fresh model: the draft path wraps modules in place
    cfg = DecodeConfig(max_new_tokens=40, k=3, fallback=False)
    ar = autoregressive(model, PROMPT + PROMPT, cfg)
    path = DraftPath(model, PLAN, options, stop_ids=(2,))
    sp = self_speculative(model, PROMPT + PROMPT, PLAN, cfg, draft=path)
    assert sp.tokens == ar.tokens
    assert autoregressive(model, PROMPT + PROMPT, cfg).tokens == ar.tokens  # wrappers are off outside drafts
    if options.weights == "int8":
        assert path.extra_bytes > 0 and path.linears
    if (options.min_ngram or options.ngram) == 1:
        assert sp.stats.copy_rounds > 0  # a 96-token vocabulary repeats single tokens soon
    if options.min_ngram:
        assert 0 < sp.stats.short_copy_rounds <= sp.stats.copy_rounds


@pytest.mark.parametrize("weights", ["model", "int8", "int4"])
def test_every_searchable_draft_is_lossless_on_one_model(weights):
    """Every combination the search space holds (on one model, drafts switching formats as trials do)."""
    import itertools

    model = tiny_model("qwen2", vocab_size=96)
    prompt = PROMPT + PROMPT
    ar = autoregressive(model, prompt, DecodeConfig(max_new_tokens=16)).tokens
    combos = itertools.product((0, 40), (0, 2), ((3, False), (4, True)), (SkipPlan(4), PLAN))
    for head, ngram, (k, adaptive), plan in combos:
        opts = DraftOptions(weights=weights, group_size=32, head_tokens=head, ngram=ngram, copy_tokens=6 if ngram else 0)
        cfg = DecodeConfig(max_new_tokens=16, k=k, adaptive=adaptive, threshold=0.3, fallback=False)
        sp = self_speculative(model, prompt, plan, cfg, draft=DraftPath(model, plan, opts, stop_ids=(2,)))
        assert sp.tokens == ar, (plan.describe(), opts, k, adaptive)


def test_wrapped_model_computes_the_same_outside_drafting():
    model = tiny_model("qwen2", vocab_size=96)
    x = torch.tensor([PROMPT])
    with torch.inference_mode():
        before = model(input_ids=x).logits
        path = DraftPath(model, PLAN, DraftOptions(weights="int8", head_tokens=10))
        path.prepare(x)
        after = model(input_ids=x).logits
        with path.drafting():
            drafted = model(input_ids=x).logits
    assert torch.equal(before, after)
    assert not torch.equal(before, drafted)
    kept = drafted[0, -1].isfinite()
    assert kept.sum() < 96 and kept[x[0]].all()  # cut head: the base ids and the prompt's tokens


@pytest.mark.parametrize("weights,tol", [("int8", 0.02), ("int4", 0.15)])
def test_quantized_linear_matches_dequantized_weights(weights, tol):
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 96, bias=True).to(torch.bfloat16)
    q = LowPrecisionLinear(lin, weights, group_size=32)
    x = torch.randn(3, 256, dtype=torch.bfloat16)
    ref = lin(x).float()
    q.active = True
    got = q(x).float()
    assert ((got - ref).norm() / ref.norm()) < tol
    q.active = False
    assert torch.equal(q(x), lin(x))


@pytest.mark.parametrize("weights,tol", [("int8", 0.02), ("int4", 0.15)])
def test_a_quantized_draft_head_scores_its_base_low_and_the_prompt_in_bf16(weights, tol):
    model = tiny_model("qwen2", vocab_size=96).to(torch.bfloat16)
    head = model.get_output_embeddings()
    x = torch.randn(2, head.in_features, dtype=torch.bfloat16)
    ref = head(x).float()
    prompt = torch.tensor([50, 70, 3, 70])
    cut = DraftPath(model, PLAN, DraftOptions(head_tokens=40, head_weights=weights, group_size=32), stop_ids=(2, 90))
    cut.prepare(prompt)
    out = model.get_output_embeddings()
    low = cut.head_choice[2]  # the path's own choice, put in place on the shared head while it drafts
    assert low is not None and low[3].shape[0] % 16 == 0  # 41 base rows padded for the int4 kernel
    with cut.drafting():
        got = out(x).float()
    base = list(range(40)) + [90]
    assert ((got[:, base] - ref[:, base]).norm() / ref[:, base].norm()) < tol
    assert torch.equal(got[:, [50, 70]], ref[:, [50, 70]])  # the prompt's own ids: bf16 rows, exact
    assert torch.isinf(got[:, [41, 60, 95]]).all()
    assert torch.equal(out(x).float(), ref)  # outside drafting: the model's head
    full = DraftPath(model, PLAN, DraftOptions(head_weights=weights, group_size=32), stop_ids=(2,))
    full.prepare(prompt)  # the same head, switched to the whole vocabulary
    with full.drafting():
        got = out(x).float()
    assert got.shape == ref.shape and ((got - ref).norm() / ref.norm()) < tol
    assert full.extra_bytes > 0
    assert "head_weights" not in DraftOptions(head_tokens=40).record()  # older runs' records stay as they were
    assert DraftOptions(head_weights="int4").record()["head_weights"] == "int4"
    with pytest.raises(SelfSpecError, match="head_weights"):
        DraftOptions(head_weights="fp8")


def test_copy_drafts_longer_than_k_stay_exact():
    model = tiny_model("qwen2", vocab_size=96)
    prompt = PROMPT * 3  # long repeats: copy drafts can run to copy_tokens
    path = DraftPath(model, PLAN, DraftOptions(ngram=1, copy_tokens=7))
    runs = {}
    for n in (40, 12):  # 12: copy drafts are cut to the room left, and the cache holds them
        cfg = DecodeConfig(max_new_tokens=n, k=2, fallback=False)
        runs[n] = self_speculative(model, prompt, PLAN, cfg, draft=path)
        assert runs[n].tokens == autoregressive(model, prompt, cfg).tokens
    assert runs[40].stats.copy_rounds > 0
    assert len(runs[40].stats.drafted_per_position) > 2  # some round drafted more than k
    assert "copy_tokens" not in DraftOptions(ngram=1).record()  # older runs' records stay as they were
    assert DraftOptions(ngram=1, copy_tokens=7).record()["copy_tokens"] == 7


def test_ngram_index_proposes_the_latest_continuation():
    idx = NGramIndex(2)
    idx.extend([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert idx.propose(3) == [5, 6, 1]  # after the latest earlier "1 2"
    idx.extend([7])
    assert idx.propose(3) == []  # "2 7" never occurred before
    assert NGramIndex(3).propose(2) == []


def test_copies_are_cut_by_the_match_length():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 10, 11, 12, 13, 14, 1, 2, 3]
    idx = NGramIndex(3, shortest=1, per_match=2)
    idx.extend(tokens)
    # "1 2 3" matched (3 tokens): up to 2*3 = 6 tokens, the k of 8 cut
    assert idx.propose(8) == [4, 5, 6, 7, 8, 9] and idx.matched == 3
    assert idx.propose(4) == [4, 5, 6, 7]  # k still caps it
    idx.extend([15, 9])  # only "9" occurred before: a 1-gram match copies 2 tokens
    assert idx.propose(8) == [2, 3] and idx.matched == 1
    uncut = NGramIndex(3, shortest=1)
    uncut.extend(tokens + [15, 9])
    assert uncut.propose(8) == [2, 3, 10, 11, 12, 13, 14, 1]
    with pytest.raises(ValueError, match="per_match"):
        NGramIndex(2, per_match=-1)
    with pytest.raises(SelfSpecError, match="copy_per_match"):
        DraftOptions(ngram=2, copy_per_match=-1)
    assert "copy_per_match" not in DraftOptions(ngram=2).record()  # older runs' records stay as they were
    cut = DraftOptions(ngram=2, copy_per_match=2)
    assert cut.record()["copy_per_match"] == 2 and DraftOptions(**cut.record()) == cut


def test_ngram_index_falls_back_to_the_longest_shorter_match():
    tokens = [1, 2, 3, 9, 4, 2, 3, 8, 5, 3, 7, 6, 3]
    idx = NGramIndex(3, shortest=1)
    idx.extend(tokens)
    # "6 3" and "7 6 3" never occurred before: the latest earlier "3" wins
    assert idx.propose(2) == [7, 6] and idx.matched == 1
    idx.extend([9])  # "3 9" occurred once, "6 3 9" never
    assert idx.propose(2) == [4, 2] and idx.matched == 2
    idx.extend([4, 2, 3])  # "4 2 3" occurred: the 3-gram beats the later "2 3" and "3"
    assert idx.propose(1) == [8] and idx.matched == 3
    idx.extend([11])
    assert idx.propose(3) == [] and idx.matched == 0  # 11 never occurred
    only = NGramIndex(3)
    only.extend(tokens)
    assert only.propose(2) == [] and only.shortest == 3  # without a shortest length, no fallback
    assert NGramIndex(2, shortest=1).propose_many(2, 3) == []  # an empty context
    with pytest.raises(ValueError, match="shortest"):
        NGramIndex(2, shortest=3)


def test_bad_draft_options():
    with pytest.raises(SelfSpecError, match="weights"):
        DraftOptions(weights="fp8")
    with pytest.raises(SelfSpecError, match="group_size"):
        DraftOptions(weights="int4", group_size=48)
    with pytest.raises(SelfSpecError, match="min_ngram"):
        DraftOptions(ngram=2, min_ngram=2)
    with pytest.raises(SelfSpecError, match="copy_fallback"):  # below the shortest match copied
        DraftOptions(ngram=3, min_ngram=1, copy_fallback=1)
    assert "min_ngram" not in DraftOptions(ngram=2).record()  # older runs' records stay as they were
    assert DraftOptions(ngram=3, min_ngram=1).record()["min_ngram"] == 1
    model = tiny_model("llama", vocab_size=96)
    path = DraftPath(model, PLAN, DraftOptions())
    with pytest.raises(SelfSpecError, match="another plan"):
        self_speculative(model, PROMPT, SkipPlan(4, attn=(2,)), DecodeConfig(max_new_tokens=4), draft=path)


def _draft_logits(model, path: DraftPath, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode(), path.drafting():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_paths_built_on_one_model_each_draft_with_their_own_weights_and_head():
    """The quantized wrappers and the cut head belong to the model, and every path of it shares them: a
    path built later (a search's next candidate, a second method of a comparison) must not change what an
    earlier one drafts with (it did: the cost model timed every low-precision format as the last one built)."""
    ids = PROMPT + PROMPT
    alone = {}
    kinds = [DraftOptions(weights="int8"), DraftOptions(weights="int4", group_size=32, head_tokens=40),
             DraftOptions(weights="int4", group_size=64, head_weights="int4")]
    for opts in kinds:  # each path on a fresh model of the same weights
        model = tiny_model("qwen2", vocab_size=96)
        path = DraftPath(model, PLAN, opts, stop_ids=(2,))
        path.prepare(torch.tensor(ids))
        alone[opts] = _draft_logits(model, path, ids)
    model = tiny_model("qwen2", vocab_size=96)
    paths = {opts: DraftPath(model, PLAN, opts, stop_ids=(2,)) for opts in kinds}
    for path in paths.values():
        path.prepare(torch.tensor(ids))  # all prepared first, as the cost model does
    for opts in [*kinds, *reversed(kinds)]:  # then used in turn, after the others
        got = _draft_logits(model, paths[opts], ids)
        assert torch.equal(got, alone[opts]), opts
        assert {(lin.kind, lin.group) for lin in paths[opts].linears} == {(opts.weights, 0 if opts.weights == "int8"
                                                                           else opts.group_size)}
    assert torch.isinf(alone[kinds[1]]).sum() > 0 and not torch.isinf(alone[kinds[0]]).any()
    sizes = {opts: paths[opts].extra_bytes for opts in kinds}
    assert sizes[kinds[0]] > sizes[kinds[2]]  # int8 copies outweigh int4 ones, whichever format is in use


@pytest.mark.parametrize("options", [DraftOptions(weights="int8"), DraftOptions(head_weights="int4")])
def test_low_precision_drafts_of_a_float64_model_are_a_clear_error(make_model, options):
    model = make_model("llama", torch.float64)  # torch's int8/int4 CPU kernels take 16- or 32-bit floats only
    with pytest.raises(SelfSpecError, match="not float64"):
        DraftPath(model, PLAN, options)
