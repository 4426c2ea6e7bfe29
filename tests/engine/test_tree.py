"""Draft trees: the trie, its mask and positions, the moved cache rows, and exact greedy output."""

import warnings

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.draft.copy import NGramIndex
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import Request, forward_at
from selfspec.engine.sampling import SamplingParams
from selfspec.engine.speculate import Speculator
from selfspec.engine.tree import DraftTree, tree_attention_mask

N = 4
# repeated n-grams with different continuations: copy drafting has several candidates at once
TREE_PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 11, 12, 3, 4, 5, 6, 7, 13] + list(range(20, 30))
TREES = {
    "copy": DraftOptions(ngram=1, copy_candidates=4, tree_nodes=12),
    "branch": DraftOptions(branch_below=0.9),
    "both_small_budget": DraftOptions(ngram=2, copy_candidates=3, branch_below=0.8, tree_nodes=6, copy_tokens=5),
    "fallback": DraftOptions(ngram=3, copy_fallback=1, copy_candidates=2, tree_nodes=10),
    "fallback_branch_small_budget": DraftOptions(ngram=2, copy_fallback=1, branch_below=0.8, tree_nodes=5,
                                                 copy_tokens=4),
    "copy_only": DraftOptions(ngram=1, copy_candidates=3, tree_nodes=6, model_draft=False),
}


def hand_tree() -> DraftTree:
    t = DraftTree(root=1, budget=10)
    assert t.add_path([2, 3, 4], "copy#1") == [1, 2, 3]
    assert t.add_path([2, 5], "copy#2") == [1, 4]  # shares the node of 2
    assert t.add_path([6], "model#2") == [5]
    return t


def test_trie_shares_prefixes_and_keeps_the_first_path_in_order():
    t = hand_tree()
    assert t.tokens == [1, 2, 3, 4, 5, 6]
    assert t.parent == [-1, 0, 1, 2, 1, 0]
    assert t.depth == [0, 1, 2, 3, 2, 1]
    assert t.drafted == 5 and t.max_depth == 3 and not t.is_chain
    anc = t.ancestors()
    assert anc[4].tolist() == [True, True, False, False, True, False]  # 5 sees 1, 2 and itself
    assert anc[3].tolist() == [True, True, True, True, False, False]


def test_tree_budget_cuts_paths():
    t = DraftTree(root=0, budget=3)
    assert t.add_path([1, 2], "a") == [1, 2]
    assert t.add_path([1, 9, 9], "b") == [1, 3]  # one new node left
    assert t.add_path([7], "c") == []
    assert t.drafted == 3
    long = DraftTree(root=0, budget=3)
    assert long.add_path([1, 2, 3, 4, 5], "copy#1") == [1, 2, 3, 4, 5]  # the first path whole: the chain's own
    assert long.add_path([1, 6], "copy#2") == [1] and long.drafted == 5


def test_greedy_acceptance_follows_the_argmax():
    t = hand_tree()
    # node -> target's argmax after it: root wants 2, after 2 the target wants 5 (the second path), then 8
    argmax = [2, 5, 0, 0, 8, 0]
    path, nxt = t.accept_greedy(argmax)
    assert path == [1, 4] and nxt == 8 and t.winner(path) == "copy#2"
    assert t.accept_greedy([6, 0, 0, 0, 0, 7]) == ([5], 7)
    assert t.accept_greedy([9, 0, 0, 0, 0, 0]) == ([], 9)
    assert t.winner([]) == "none"


def test_tree_mask_and_sliding_window(make_model):
    t = hand_tree()
    llama = make_model("llama")
    m = tree_attention_mask(llama, t, start=3, device="cpu")
    assert m.shape == (1, 1, 6, 9) and m.dtype == torch.bool
    assert m[0, 0, :, :3].all()  # committed slots
    assert torch.equal(m[0, 0, :, 3:], t.ancestors())
    gemma = make_model("gemma3")  # sliding window 8, on position ids
    masks = tree_attention_mask(gemma, t, start=10, device="cpu")
    assert set(masks) == {"full_attention", "sliding_attention"}
    full, sliding = masks["full_attention"][0, 0], masks["sliding_attention"][0, 0]
    assert full[:, :10].all()
    # node 3 (depth 3, position 13) sees keys at positions > 5: slots 6..9, then its ancestors
    assert sliding[3, :10].tolist() == [False] * 6 + [True] * 4
    assert sliding[3, 10:].tolist() == [True, True, True, True, False, False]
    assert sliding[0, :10].tolist() == [False] * 3 + [True] * 7  # the root at position 10


@pytest.mark.parametrize("tree", list(TREES))
@pytest.mark.parametrize("plan", [SkipPlan(N), SkipPlan(N, attn=(0, 2), mlp=(1,))], ids=["empty", "skips"])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_tree_speculation_equals_autoregressive(model, tree, plan, k):
    cfg = DecodeConfig(max_new_tokens=40, k=k, fallback=False)
    ar = autoregressive(model, TREE_PROMPT, cfg)
    sp = self_speculative(model, TREE_PROMPT, plan, cfg, draft=DraftPath(model, plan, TREES[tree]))
    assert sp.tokens == ar.tokens
    s = sp.stats
    assert s.tree_rounds > 0 and s.tree_nodes >= 2 * s.tree_rounds
    assert sum(s.tree_wins.values()) == s.tree_rounds
    assert s.new_tokens == len(sp.tokens) == 40


def test_a_branch_other_than_the_first_wins_and_stays_exact(make_model):
    model = make_model("gemma3", torch.float64)  # crosses the sliding window of 8
    cfg = DecodeConfig(max_new_tokens=60, k=4, fallback=False)
    ar = autoregressive(model, TREE_PROMPT, cfg)
    wins = {}
    for opts in TREES.values():
        sp = self_speculative(model, TREE_PROMPT, SkipPlan(N, attn=(1,)), cfg,
                              draft=DraftPath(model, SkipPlan(N, attn=(1,)), opts))
        assert sp.tokens == ar.tokens
        for name, v in sp.stats.tree_wins.items():
            wins[name] = wins.get(name, 0) + v
    assert any(name not in ("model", "copy#1", "none") for name in wins), wins  # a later candidate won


def test_accepted_path_rows_equal_a_fresh_forward(make_model):
    model = make_model("qwen2", torch.float64)
    cfg = DecodeConfig(max_new_tokens=10, k=4, fallback=False)
    truth = autoregressive(model, TREE_PROMPT, cfg).tokens
    run = Request(model, TREE_PROMPT, cfg, (), "self_speculative", extra_slots=12)
    spec = Speculator(run, DraftPath(model, SkipPlan(N), DraftOptions()))
    with torch.inference_mode():
        spec.start()
        start = run.pos
        tree = DraftTree(run.pending, budget=10)
        wrong = (truth[1] + 1) % 96
        tree.add_path([wrong, 3, 4], "copy#1")  # a wrong first path takes slots 1..3
        tree.add_path(truth[1:4], "copy#2")  # the right one sits at slots 4..6
        path, nxt = spec.verify_tree(tree)
        assert path == [4, 5, 6] and nxt == truth[4]
        fresh = PositionalKVCache(model, max_len=len(TREE_PROMPT) + 4)
        forward_at(model, fresh, torch.tensor(TREE_PROMPT + truth[:4]), 0, keep=1)
        for mine, ref in zip(run.cache.layers, fresh.layers):
            torch.testing.assert_close(mine.keys[:, :, : start + 4], ref.keys[:, :, : start + 4], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(mine.values[:, :, : start + 4], ref.values[:, :, : start + 4],
                                       rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("max_new", [1, 2, 3, 6, 9])
def test_max_new_tokens_inside_a_tree(model, max_new):
    cfg = DecodeConfig(max_new_tokens=max_new, k=4, fallback=False)
    ar = autoregressive(model, TREE_PROMPT, cfg)
    for opts in TREES.values():
        sp = self_speculative(model, TREE_PROMPT, SkipPlan(N), cfg, draft=DraftPath(model, SkipPlan(N), opts))
        assert sp.tokens == ar.tokens and len(sp.tokens) == max_new
        assert sp.stats.stop_reason == "max_new_tokens"


def test_eos_inside_a_branch(model):
    cfg = DecodeConfig(max_new_tokens=40, k=4, fallback=False)
    reference = autoregressive(model, TREE_PROMPT, cfg).tokens
    eos = next(t for i, t in enumerate(reference[3:], 3) if t not in reference[:i])
    ar = autoregressive(model, TREE_PROMPT, cfg, eos_ids={eos})
    for opts in TREES.values():
        sp = self_speculative(model, TREE_PROMPT, SkipPlan(N), cfg, eos_ids={eos},
                              draft=DraftPath(model, SkipPlan(N), opts))
        assert sp.tokens == ar.tokens and sp.tokens[-1] == eos
        assert sp.stats.stop_reason == "eos"


def test_sampling_verifies_trees_without_a_warning(make_model):
    """Sampling runs verify trees too (their distribution: tests/engine/test_sampling.py)."""
    model = make_model("llama")
    for name in ("copy", "fallback_branch_small_budget"):
        tree_rounds = 0
        for seed in range(4):  # a round is a tree only when it has several candidates
            cfg = DecodeConfig(max_new_tokens=20, k=3, fallback=False, seed=seed,
                               sampling=SamplingParams(temperature=0.8))
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                sp = self_speculative(model, TREE_PROMPT, SkipPlan(N), cfg,
                                      draft=DraftPath(model, SkipPlan(N), TREES[name]))
            assert len(sp.tokens) == 20
            tree_rounds += sp.stats.tree_rounds
        assert tree_rounds > 0, name


def test_ngram_index_proposes_distinct_candidates_latest_first():
    idx = NGramIndex(1)
    idx.extend([5, 1, 2, 5, 3, 4, 5, 1, 2, 5])
    assert idx.propose_many(2, 3) == [[1, 2], [3, 4]]  # the two [1, 2] continuations count once
    assert idx.propose_many(2, 1) == [[1, 2]] and idx.propose(2) == [1, 2]
    assert NGramIndex(3).propose_many(2, 3) == []


def test_tree_options_are_recorded_only_when_on():
    assert DraftOptions(ngram=1, copy_candidates=1).record() == DraftOptions(ngram=1).record()
    assert "tree_nodes" not in DraftOptions(ngram=1).record()
    assert DraftOptions(copy_candidates=3).tree is False  # no copy drafting, no candidates
    rec = DraftOptions(ngram=1, copy_candidates=3).record()
    assert rec["copy_candidates"] == 3 and rec["tree_nodes"] == 12
    assert DraftOptions(branch_below=0.3).record()["branch_below"] == 0.3
    a, b = DraftSpec(SkipPlan(N), DraftOptions(ngram=1)), DraftSpec(SkipPlan(N), DraftOptions(ngram=1, copy_candidates=3))
    assert a.key != b.key and "3 copy candidates" in b.describe()
    with pytest.raises(Exception, match="branch_below"):
        DraftOptions(branch_below=1.5)
    assert "copy_fallback" not in DraftOptions(ngram=2, copy_candidates=3).record()
    fb = DraftOptions(ngram=2, copy_fallback=1)
    assert fb.tree and fb.record()["copy_fallback"] == 1 and "1-gram copies" in DraftSpec(SkipPlan(N), fb).describe()
    assert DraftSpec(SkipPlan(N), fb).key != DraftSpec(SkipPlan(N), DraftOptions(ngram=2)).key
    for bad in (DraftOptions, lambda **o: DraftOptions(ngram=1, **o), lambda **o: DraftOptions(ngram=2, **o)):
        with pytest.raises(Exception, match="copy_fallback"):
            bad(copy_fallback=2)


def test_shorter_copies_join_the_model_draft_where_no_ngram_matched(make_model):
    model = make_model("gemma3", torch.float64)  # this one's continuation repeats a 1-gram's earlier one
    cfg = DecodeConfig(max_new_tokens=40, k=3, fallback=False)
    want = autoregressive(model, TREE_PROMPT, cfg).tokens
    plan = SkipPlan(N, attn=(1,))
    # one copy candidate and no branching: every tree comes from a 1-gram copy beside the model draft
    got = self_speculative(model, TREE_PROMPT, plan, cfg,
                           draft=DraftPath(model, plan, DraftOptions(ngram=4, copy_fallback=1, tree_nodes=12)))
    assert got.tokens == want
    assert got.stats.tree_rounds > 0 and got.stats.copy_rounds < got.stats.rounds
    assert any(w.startswith("copy1#") for w in got.stats.tree_wins), got.stats.tree_wins
