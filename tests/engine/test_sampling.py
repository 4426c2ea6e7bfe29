"""Speculative sampling keeps the target distribution.

Each statistical test compares empirical counts with exact probabilities by a
chi-square test and fails when its p-value is below ALPHA = 1e-6: a correct
implementation fails each such test with probability at most 1e-6 (seeds are
fixed, so in practice a given run always passes or always fails).
"""

import math

import pytest
import torch

from selfspec import DecodeConfig, SamplingParams, SkipPlan, self_speculative
from selfspec.assets.tiny import tiny_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.sampling import greedy_ids, probs_from_logits, sample, verify_greedy, verify_sampling
from selfspec.engine.speculate import Speculator
from selfspec.engine.tree import DraftTree

ALPHA = 1e-6


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (regularized upper gamma, series form)."""
    s, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / s
    n = 1
    while term > 1e-16 * total:
        term *= z / (s + n)
        total += term
        n += 1
    lower = math.exp(s * math.log(z) - z - math.lgamma(s)) * total
    return max(0.0, 1.0 - lower)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with target probability 0 was produced"
    stat = ((counts[keep].double() - expected[keep]) ** 2 / expected[keep]).sum().item()
    return chi2_sf(stat, int(keep.sum()) - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_ids_are_argmax_ties_and_all(dtype):
    torch.manual_seed(0)
    logits = torch.randn(7, 5000).to(dtype)
    logits[1, [17, 40, 4000]] = 9.0  # equal maxima: the first wins, as with argmax
    logits[2] = logits[2].round()  # many equal values
    logits[3, 100] = float("inf")
    logits[4] = float("-inf")
    logits[4, 4321] = 0.0
    assert torch.equal(greedy_ids(logits), logits.argmax(-1)) and int(greedy_ids(logits)[1]) == 17
    assert int(greedy_ids(logits[0])) == int(logits[0].argmax())  # one row


def test_chi2_helper_against_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chi2_sf(9.487729036781154, 4) == pytest.approx(0.05, abs=1e-9)


def test_verify_sampling_first_token_is_distributed_as_p():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15, 0.0])
    q = torch.tensor([0.30, 0.10, 0.20, 0.05, 0.05, 0.30])  # puts mass where p has none
    n = 20_000
    counts = torch.zeros(6)
    accepted = 0
    for _ in range(n):
        x = torch.multinomial(q, 1, generator=g)
        k_acc, nxt = verify_sampling(x, q[None], torch.stack([p, p]), g)
        first = int(x) if k_acc == 1 else nxt
        counts[first] += 1
        accepted += k_acc
    assert chi2_pvalue(counts, p) > ALPHA
    expected_acceptance = torch.minimum(p, q).sum().item()  # sum_x min(p, q)
    assert abs(accepted / n - expected_acceptance) < 5 * math.sqrt(0.25 / n)


def test_verify_greedy():
    logits = torch.tensor([[0.0, 5, 0], [9, 0, 0], [0, 0, 3]])
    assert verify_greedy(torch.tensor([1, 0]), logits) == (2, 2)
    assert verify_greedy(torch.tensor([1, 2]), logits) == (1, 0)
    assert verify_greedy(torch.tensor([0, 0]), logits) == (0, 1)


def test_top_k_top_p_filters():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0, 0]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert (p > 0).sum() == 3


def _marginals(model, prompt, params, vocab):
    """Exact marginals of new tokens 2 and 3, by enumerating the first two."""
    with torch.inference_mode():
        def dist(ctx):
            return probs_from_logits(model(input_ids=torch.tensor([ctx])).logits[0, -1], params).double()
        p1 = dist(prompt)
        p2 = torch.zeros(vocab, dtype=torch.float64)
        p3 = torch.zeros(vocab, dtype=torch.float64)
        for a in range(vocab):
            pa = dist(prompt + [a])
            p2 += p1[a] * pa
            for b in range(vocab):
                p3 += p1[a] * pa[b] * dist(prompt + [a, b])
    return p2, p3


@pytest.mark.parametrize("params,draft", [
    (SamplingParams(temperature=1.0), None),
    pytest.param(SamplingParams(temperature=0.8, top_k=6), None, marks=pytest.mark.slow),  # truncation: top_p runs
    (SamplingParams(temperature=0.9, top_p=0.8), None),
    # copied drafts (point-mass proposals) and a cut draft head (zero proposal mass off 4 ids)
    (SamplingParams(temperature=1.0), DraftOptions(head_tokens=4, ngram=1)),
    # draft trees: the model's drawn path with its likeliest other token wherever q is unsure; several
    # copies; shorter copies beside the drawn path (multi-candidate rejection sampling)
    (SamplingParams(temperature=1.0), DraftOptions(branch_below=0.99, tree_nodes=6)),
    (SamplingParams(temperature=0.9, top_p=0.9), DraftOptions(ngram=1, copy_candidates=3, tree_nodes=6)),
    # copies and branches in one tree (each runs alone above): a second variant, left out of the default run
    pytest.param(SamplingParams(temperature=1.0), DraftOptions(ngram=2, copy_fallback=1, copy_candidates=3,
                                                               branch_below=0.99, tree_nodes=8), marks=pytest.mark.slow),
], ids=["plain", "top_k", "top_p", "copy_cut_head", "tree_branch", "tree_copies", "tree_fallback_branch"])
def test_engine_samples_the_target_distribution(make_model, params, draft):
    """Tokens 2 and 3 of a request (made by draft/verify rounds) follow the model's own distribution."""
    vocab = 8
    if draft is None:
        model = make_model("llama", torch.float64, vocab)
    else:
        model = tiny_model("llama", dtype=torch.float64, vocab_size=vocab)
    prompt = [1, 5, 1, 6, 3, 1]  # 1 repeats with different continuations: several copy candidates
    plan = SkipPlan(4, attn=(1,), mlp=(1, 2))
    p2, p3 = _marginals(model, prompt, params, vocab)
    path = DraftPath(model, plan, draft) if draft is not None else None
    n = 1000
    c2, c3 = torch.zeros(vocab), torch.zeros(vocab)
    drafted = accepted = tree_rounds = 0
    for seed in range(n):
        cfg = DecodeConfig(max_new_tokens=3, k=2, sampling=params, seed=seed, fallback=False)
        g = self_speculative(model, prompt, plan, cfg, draft=path)
        c2[g.tokens[1]] += 1
        c3[g.tokens[2]] += 1
        drafted += g.stats.drafted
        accepted += g.stats.accepted
        tree_rounds += g.stats.tree_rounds
    assert 0 < accepted < drafted  # both the accept and the residual-resample paths ran
    if draft is not None and draft.tree:
        assert tree_rounds > 0
    assert chi2_pvalue(c2, p2) > ALPHA
    assert chi2_pvalue(c3, p3) > ALPHA


def test_the_gate_keeps_the_target_distribution(make_model, monkeypatch):
    """Plain steps the gate takes between copy and model rounds draw from the model's own distribution."""
    vocab, params = 8, SamplingParams(temperature=1.0)
    model = tiny_model("llama", dtype=torch.float64, vocab_size=vocab)
    prompt = [1, 5, 1, 6, 3, 1]
    plan = SkipPlan(4, attn=(1,), mlp=(1, 2))
    _, p3 = _marginals(model, prompt, params, vocab)
    # a rule that looks only at the past: a plain step after an odd number of new tokens
    monkeypatch.setattr(Speculator, "model_draft_pays", lambda self: self.run.stats.new_tokens % 2 == 0)
    path = DraftPath(model, plan, DraftOptions(ngram=1))
    c3, gated = torch.zeros(vocab), 0
    for seed in range(600):  # fewer draws than above: the plain step is the AR step; this checks the hand-over
        cfg = DecodeConfig(max_new_tokens=3, k=2, sampling=params, seed=seed, fallback=False, gate=True)
        g = self_speculative(model, prompt, plan, cfg, draft=path)
        c3[g.tokens[2]] += 1
        gated += g.stats.gated_steps
    assert gated > 0
    assert chi2_pvalue(c3, p3) > ALPHA


def test_tree_acceptance_keeps_the_target_distribution_along_every_path():
    """A hand-built tree under the pending token: a drawn two-token path first, then chosen tokens
    beside it at both levels. The first token must follow the root's p; the token after an
    accepted first token must follow that node's p."""
    g = torch.Generator().manual_seed(1)
    vocab = 6
    rows = torch.rand(1 + vocab, vocab, generator=g) ** 3  # sharp-ish, uneven distributions
    rows[0, 5] = 0.0  # a token the target never emits at the root (the copy below proposes it)
    rows = rows / rows.sum(-1, keepdim=True)
    p_root, p_after = rows[0], rows[1:]  # p_after[a]: the target's p after token a
    q0 = torch.tensor([0.05, 0.5, 0.05, 0.3, 0.05, 0.05])
    q1 = torch.full((vocab,), 1.0 / vocab)
    n = 20_000
    first, second = torch.zeros(vocab), torch.zeros(vocab, vocab)
    for _ in range(n):
        x0, x1 = int(sample(q0, g)), int(sample(q1, g))
        tree = DraftTree(root=0, budget=10)
        drawn = tree.add_path([x0, x1], "model", proposals=[q0, q1])
        tree.add_path([3, 2], "copy#1")  # chosen; shares x0's node when x0 == 3
        tree.add_path([5], "copy#2")
        tree.add_path([4], "model#2", parent=drawn[0])
        # p at each node: the root's, or the one after the node's token (depth 1), any at depth 2
        p = torch.stack([p_root] + [p_after[t] for t in tree.tokens[1:]])
        path, nxt = tree.accept_sampling(p, g)
        out = [tree.tokens[i] for i in path] + [nxt]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    assert chi2_pvalue(first, p_root) > ALPHA
    seen = 0
    for a in range(vocab):
        if second[a].sum() >= 300:
            assert chi2_pvalue(second[a], p_after[a]) > ALPHA
            seen += 1
    assert seen >= 2
    with pytest.raises(ValueError, match="tried first"):
        t = DraftTree(root=0, budget=4)
        t.add_path([1], "copy#1")
        t.add_path([2], "model", proposals=[q0])


def test_nucleus_from_a_partial_top_k_equals_the_one_from_a_full_sort():
    torch.manual_seed(0)
    for scale in (0.5, 3.0, 12.0):  # flat (the nucleus spills past the first candidates) to peaked
        logits = torch.randn(3, 5000) * scale
        for top_p in (0.3, 0.9, 0.999):
            params = SamplingParams(temperature=0.7, top_p=top_p)
            probs = (logits / 0.7).softmax(-1)
            sorted_p, order = probs.sort(-1, descending=True)
            drop = (sorted_p.cumsum(-1) - sorted_p >= top_p).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p >= top_p)
            want = probs.masked_fill(drop, 0.0)
            want = want / want.sum(-1, keepdim=True)
            torch.testing.assert_close(probs_from_logits(logits, params), want)


def test_sample_draws_each_token_with_its_probability_and_never_a_zero_one():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    g = torch.Generator().manual_seed(0)
    draws = sample(probs.expand(20000, -1), g)
    counts = torch.bincount(draws, minlength=6).float()
    assert chi2_pvalue(counts, probs) > ALPHA
    assert int(sample(torch.tensor([0.0, 0.0, 1.0, 0.0]), g)) == 2 and sample(probs, g).shape == ()
