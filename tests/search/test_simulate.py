"""The round simulator is exact: in fp64 on tiny models, for any draft, its counts equal a real greedy run's."""

import functools
from dataclasses import replace

import pytest
import torch

from selfspec import DecodeConfig, SkipPlan, autoregressive, self_speculative
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.search.rounds import RoundCounts, decode_config_of
from selfspec.search.simulate import RoundSimulator
from tests.helpers import PROMPT

N_LAYERS = 4
SPECS = {
    "skip": DraftSpec(SkipPlan(N_LAYERS, attn=(1,), mlp=(2,)), k=3),
    "skip_k5": DraftSpec(SkipPlan(N_LAYERS, attn=(1, 2), mlp=(2,)), k=5),
    "copy": DraftSpec(SkipPlan(N_LAYERS, attn=(2,)), DraftOptions(ngram=1, copy_tokens=6), k=2),
    "short_copy": DraftSpec(SkipPlan(N_LAYERS, attn=(2,)), DraftOptions(ngram=3, min_ngram=1, copy_tokens=6), k=2),
    "head": DraftSpec(SkipPlan(N_LAYERS, mlp=(1,)), DraftOptions(head_tokens=40), k=4),
    "adaptive": DraftSpec(SkipPlan(N_LAYERS, attn=(1,)), k=4, adaptive=True, threshold=0.3),
    "adaptive_fixed": DraftSpec(SkipPlan(N_LAYERS, attn=(1,)), k=4, adaptive=True, threshold=0.3, threshold_step=0.0),
    "grow": DraftSpec(SkipPlan(N_LAYERS, mlp=(2,)), DraftOptions(ngram=3, copy_tokens=4), k=1, k_max=5),
    "grow_tree": DraftSpec(SkipPlan(N_LAYERS, mlp=(2,)), DraftOptions(ngram=1, copy_tokens=6, copy_candidates=3,
                                                                      tree_nodes=10), k=1, k_max=4),
    "copy_tree": DraftSpec(SkipPlan(N_LAYERS, attn=(2,)), DraftOptions(ngram=1, copy_tokens=6, copy_candidates=3,
                                                                       tree_nodes=10), k=2),
    "copy_tree_small_budget": DraftSpec(SkipPlan(N_LAYERS, attn=(2,)), DraftOptions(ngram=1, copy_tokens=6,
                                                                                    copy_candidates=3, tree_nodes=5), k=2),
    "branch_tree": DraftSpec(SkipPlan(N_LAYERS, attn=(1,), mlp=(2,)), DraftOptions(branch_below=0.6, tree_nodes=5),
                             k=4),
    "fallback_tree": DraftSpec(SkipPlan(N_LAYERS, attn=(1,)), DraftOptions(ngram=3, copy_fallback=1, copy_tokens=3,
                                                                          copy_candidates=2, tree_nodes=20), k=3),
    "copy_only": DraftSpec(SkipPlan(N_LAYERS), DraftOptions(ngram=2, min_ngram=1, copy_tokens=5, model_draft=False),
                           k=1),
    "copy_per_match": DraftSpec(SkipPlan(N_LAYERS), DraftOptions(ngram=3, min_ngram=1, copy_tokens=8, copy_per_match=2,
                                                                 model_draft=False), k=1),
    "copy_only_tree": DraftSpec(SkipPlan(N_LAYERS), DraftOptions(ngram=1, copy_candidates=3, tree_nodes=6,
                                                                 model_draft=False), k=3),
}
PROMPTS = [PROMPT, [5, 9, 11, 5, 9, 11, 5, 9, 11, 7], list(range(40, 60)),
           [5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 11, 12, 3, 4, 5, 6, 7, 13]]


@functools.cache
def _ar(model, lengths: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The model's greedy continuations of PROMPTS, ``lengths`` tokens each (computed once per shared model)."""
    return tuple(tuple(autoregressive(model, p, DecodeConfig(max_new_tokens=n)).tokens) for p, n in zip(PROMPTS, lengths))


def _continuations(model, *lengths: int) -> list[list[int]]:
    return [list(c) for c in _ar(model, lengths if len(lengths) > 1 else lengths * len(PROMPTS))]


@pytest.mark.parametrize("name", list(SPECS))
def test_simulated_rounds_equal_a_real_greedy_run(make_model, arch, name):
    model = make_model(arch, torch.float64)
    spec = SPECS[name]
    n_tokens = 30
    conts = _continuations(model, n_tokens)
    sim = RoundSimulator(model, PROMPTS, conts)
    path = DraftPath(model, spec.plan, spec.options)
    counts = sim.simulate(spec, path)
    cfg = decode_config_of(spec, DecodeConfig(max_new_tokens=n_tokens, fallback=False))
    real = [self_speculative(model, p, spec.plan, cfg, draft=path) for p in PROMPTS]
    assert [g.tokens for g in real] == conts  # greedy: the draft changes the rounds, never the text
    assert counts.accepted == sum(g.stats.accepted for g in real)
    assert counts.rounds == sum(g.stats.rounds for g in real)
    copy_trees = sum(v for (m, _), v in counts.tree_rounds.items() if m == 0)
    assert sum(counts.copy_rounds.values()) + copy_trees == sum(g.stats.copy_rounds for g in real)
    assert sum(counts.tree_rounds.values()) == sum(g.stats.tree_rounds for g in real)
    assert sum(n * v for (_, n), v in counts.tree_rounds.items()) == sum(g.stats.tree_nodes for g in real)
    if spec.options.tree:
        assert counts.tree_rounds, "the prompts should make this draft branch"
    assert counts.tokens == sum(g.stats.new_tokens - 1 for g in real)
    if not spec.adaptive:  # the adaptive exit's drafted length is exact only while the draft agrees
        assert counts.drafted == sum(g.stats.drafted for g in real)
    if spec.k_max:  # the draft grew past k after rounds accepted whole, in both
        longest = max([*counts.model_rounds, *(m for m, _ in counts.tree_rounds)])
        assert longest > spec.k and max(len(g.stats.drafted_per_position) for g in real) >= longest
    assert counts.rounds > 0 and 0 < counts.accepted
    if not spec.options.model_draft:  # every round copied, a plain step wherever nothing matched
        assert counts.rounds == sum(g.stats.copy_rounds for g in real)
        assert counts.plain_steps >= sum(g.stats.gated_steps for g in real) > 0


@pytest.mark.parametrize("name", ["skip", "head", "adaptive", "branch_tree"])
def test_prompts_side_by_side_count_as_one_by_one(make_model, name):
    """One batched forward per round step over all prompts (rows leave as their prompts end, so later steps
    run a non-contiguous subset) gives each prompt's counts exactly as simulating it alone."""
    model = make_model("qwen2", torch.float64)
    spec = SPECS[name]
    conts = _continuations(model, 30, 8, 20, 14)
    sim = RoundSimulator(model, PROMPTS, conts)
    together = sim.simulate(spec)
    alone = RoundCounts()
    for i in range(len(PROMPTS)):
        alone.add(RoundSimulator(model, PROMPTS[i : i + 1], conts[i : i + 1]).simulate(spec))
    assert together == alone and together.rounds > 0
    middle = sim.simulate(spec, prompts=range(1, 3))  # a batch of some prompts only
    assert middle == sum_counts(RoundSimulator(model, PROMPTS[j : j + 1], conts[j : j + 1]).simulate(spec)
                                for j in (1, 2))


@pytest.mark.parametrize("name", ["skip", "skip_k5", "adaptive", "head", "branch_tree", "fallback_tree"])
def test_lazy_rows_count_as_whole_chunks(make_model, name):
    """Drafting a chain's round one position a forward up to its first miss (or adaptive stop) gives the
    counts of drafting its whole chunk at once, computing fewer positions; a tree's rounds run whole."""
    model = make_model("llama", torch.float64)
    spec = SPECS[name]
    conts = _continuations(model, 30, 8, 20, 14)
    lazy, whole = RoundSimulator(model, PROMPTS, conts), RoundSimulator(model, PROMPTS, conts, lazy=False)
    counts = lazy.simulate(spec)
    assert counts == whole.simulate(spec) and counts.rounds > 0
    assert lazy.forwards >= whole.forwards
    if spec.options.tree and spec.options.branch_below:
        assert lazy.rows == whole.rows
    else:
        assert lazy.rows < whole.rows
    k5 = replace(spec, k=spec.k + 2)  # a longer chunk of the same forward: the memo's partial chunks extended
    assert lazy.simulate(k5) == RoundSimulator(model, PROMPTS, conts, lazy=False).simulate(k5)


def sum_counts(parts) -> RoundCounts:
    total = RoundCounts()
    for p in parts:
        total.add(p)
    return total


def test_counts_round_trip():
    from selfspec.search.rounds import RoundCounts

    c = RoundCounts(10, 1, {2: 3}, {5: 1}, 11, 6, {(0, 7): 2, (3, 5): 1})
    assert RoundCounts.from_dict(c.to_dict()) == c
    old = c.to_dict()
    del old["tree_rounds"]  # trials stored before draft trees existed
    assert RoundCounts.from_dict(old).tree_rounds == {}


def test_drafts_sharing_a_forward_reuse_its_outputs(make_model):
    """A draft's outputs at a round start depend only on its forward (skips, weights, head): one simulator
    serving several drafts of one forward counts each exactly as a fresh simulator does, and runs each
    chunk once."""
    model = make_model("llama", torch.float64)
    plan = SkipPlan(N_LAYERS, attn=(1,), mlp=(2,))
    drafts = [DraftSpec(plan, k=3), DraftSpec(plan, k=5, adaptive=True, threshold=0.3),
              DraftSpec(plan, DraftOptions(branch_below=0.6, tree_nodes=5), k=4),
              DraftSpec(plan, DraftOptions(ngram=3, copy_fallback=1, copy_tokens=3, copy_candidates=2), k=2),
              DraftSpec(SkipPlan(N_LAYERS, attn=(1,)), k=3)]  # another forward: no outputs of the others
    conts = _continuations(model, 24)
    shared = RoundSimulator(model, PROMPTS, conts)
    for spec in drafts:
        assert shared.simulate(spec) == RoundSimulator(model, PROMPTS, conts).simulate(spec)
    ran = shared.forwards
    assert 0 < ran
    for spec in drafts:  # everything asked again is known
        shared.simulate(spec)
    assert shared.forwards == ran
    fresh = RoundSimulator(model, PROMPTS, conts)
    for spec in drafts:
        fresh.simulate(spec)
        fresh.memo.clear()
    assert fresh.forwards > ran  # the drafts of one forward asked for chunks the others had run
    assert len(shared.memo) == 2


@pytest.mark.parametrize("name", ["skip", "adaptive", "copy"])
def test_the_oracle_accepts_every_model_draft(make_model, name):
    """The oracle's model rounds accept all they drafted (its copy rounds are the draft's own), so it emits the same
    tokens in no more rounds than the draft, each model round k + 1 tokens but where the continuation's end cuts k."""
    model = make_model("llama", torch.float64)
    spec = SPECS[name]
    conts = _continuations(model, 30)
    sim = RoundSimulator(model, PROMPTS, conts)
    real, oracle = sim.simulate(spec), sim.simulate(spec, oracle=True)
    assert oracle.tokens == real.tokens and oracle.rounds <= real.rounds
    assert real.accepted < real.drafted, "the tiny model's draft should miss somewhere"
    assert oracle.tokens_per_round > real.tokens_per_round
    if not spec.options.ngram:
        assert oracle.accepted == oracle.drafted
        if not spec.adaptive:
            assert max(oracle.model_rounds) == spec.k and sum(oracle.model_rounds.values()) <= -(-30 // (spec.k + 1)) * 4


@pytest.mark.parametrize("name", ["skip", "copy"])
def test_the_stopping_oracle_drafts_exactly_what_the_target_accepts(make_model, name):
    """The stopping oracle makes the draft's rounds with each model chain cut after its accepted tokens: the same
    tokens, accepted and rounds, fewer drafted (every model-drafted token accepted), copies as the draft's."""
    model = make_model("llama", torch.float64)
    spec = SPECS[name]
    conts = _continuations(model, 30)
    sim = RoundSimulator(model, PROMPTS, conts)
    real, stop = sim.simulate(spec), sim.simulate(spec, stop=True)
    assert real.accepted < real.drafted, "the tiny model's draft should miss somewhere"
    assert (stop.tokens, stop.accepted) == (real.tokens, real.accepted)
    assert stop.rounds + stop.plain_steps == real.rounds + real.plain_steps  # the same rounds, where they fall
    assert stop.drafted < real.drafted
    if not spec.options.ngram:
        assert stop.accepted == stop.drafted
    assert stop.copy_rounds == real.copy_rounds  # copies as the draft makes them
    assert stop.plain_steps - real.plain_steps == real.model_rounds.total() - stop.model_rounds.total() > 0


@pytest.mark.parametrize("name", ["copy", "skip_k5"])
def test_copying_from_inside_a_round_keeps_the_tokens_and_drafts_less(make_model, name):
    """Turning to a copy inside a model chain emits the same tokens and drafts fewer with the model where the
    continuations repeat the prompts' n-grams; a draft that copies nothing is unchanged."""
    model = make_model("llama", torch.float64)
    spec = SPECS[name]
    conts = _continuations(model, 30)
    sim = RoundSimulator(model, PROMPTS, conts)
    real, inside = sim.simulate(spec), sim.simulate(spec, copy_inside=True)
    assert inside.tokens == real.tokens
    if not spec.options.ngram:
        assert inside.to_dict() == real.to_dict()
        return
    assert inside.model_drafted < real.model_drafted
    # each turned round: its model tokens, then the copy, verified as one chain no wider than the loop's widest
    assert real.tree_rounds.total() == 0 < inside.tree_rounds.total()
    widest = spec.options.longest_verify(spec.k)
    assert all(1 <= m < nodes <= widest for m, nodes in inside.tree_rounds)
