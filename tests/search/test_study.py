"""The search's study: deterministic objectives, re-timing, rescoring on another machine, budgets, warm starts,
resuming, and its storage."""

import socket
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import optuna
import pytest

from selfspec import SelfSpecError, SkipPlan
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec
from selfspec.search import workers
from selfspec.search.costs import CostModel
from selfspec.search.rounds import RoundCounts
from selfspec.search.simulate import RoundSimulator
from selfspec.search.space import DraftDims, SearchSpace
from selfspec.search.study import (
    Evaluation,
    PredictedObjective,
    enqueue_warm_starts,
    finished,
    open_study,
    run_search,
    top_drafts,
)
from tests.search.toy import COSTS, PROMPTS


def test_objective_is_deterministic_for_a_draft(tiny, simulator):
    spec = DraftSpec(SkipPlan(4, attn=(1,), mlp=(2,)), DraftOptions(ngram=2), k=3)
    obj = PredictedObjective(simulator, COSTS)
    a, b = obj(spec), obj(spec)
    conts = simulator.continuations
    fresh = PredictedObjective(RoundSimulator(tiny, PROMPTS, conts), COSTS)(spec)
    assert (a.value, a.acceptance) == (b.value, b.acceptance) == (fresh.value, fresh.acceptance)
    assert obj(DraftSpec(SkipPlan(4), k=3)).acceptance == 1.0  # fp32: the full model agrees with its own continuation


def test_retime_hands_back_the_full_models_continuations(tiny, simulator):
    from selfspec.search.retime import retime

    spec = DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(ngram=2), k=2)
    tokens: list[list[int]] = []
    (m,) = retime(tiny, PROMPTS, [spec], (), max_new_tokens=12, reps=2, ar_tokens=tokens)
    assert tokens == simulator.continuations  # AR's greedy tokens on each prompt, first repetition, in order
    assert m["decode_speedup"] > 0 and len(m["decode_speedup_range"]) == 2


def test_a_study_on_another_machine_is_rescored_from_its_round_counts(tmp_path, simulator):
    space = SearchSpace(4, dims=DraftDims(head_tokens=(0,), threshold=(0.4,), group_size=(32,)))
    study = open_study(tmp_path / "s.db", "m", "tiny", "random", 0)
    run_search(study, space, PredictedObjective(simulator, COSTS), n_trials=12)
    slow_verify = CostModel.from_dict({**COSTS.to_dict(), "t_verify": {str(m): 3.0 for m in range(2, 14)}})
    here = top_drafts(study, space, 12)
    there = top_drafts(study, space, 12, costs=slow_verify)
    assert {r.spec.key for r in here} == {d.key for r in there for d in (r.spec, *r.twins)}  # twins count once
    for r in there:
        counts = RoundCounts.from_dict(r.trial.user_attrs["counts"])
        assert r.value == pytest.approx(slow_verify.predicted_speedup(counts, r.spec))
        if counts.rounds:
            assert r.value < r.trial.value  # a dearer verify pass makes every draft that verifies slower
        else:  # a copy-only draft that never matched took plain steps only: no verify to price
            assert r.value == r.trial.value
    assert [r.value for r in there] == sorted((r.value for r in there), reverse=True)


def test_drafts_predicted_alike_are_re_timed_once(tmp_path):
    """Copy drafts whose n-gram sizes found the same matches are twins: one stands for them, the next
    places go to drafts that differ, and with no counts (the wall-clock objective) nothing is merged."""
    space = SearchSpace(4, dims=DraftDims(model_draft=(False,), ngram=(2, 3, 4, 8), copy_tokens=(5, 10), min_ngram=(0,)))
    study = open_study(tmp_path / "s.db", "twins", "tiny", "random", 0)

    def objective(spec):  # the counts depend on the copy length only: the n-gram sizes are twins
        long = spec.options.copy_tokens == 10
        counts = RoundCounts(tokens=40, plain_steps=4, copy_rounds=Counter({10 if long else 5: 6 if long else 8}),
                             drafted=60 if long else 40, accepted=30 if long else 28)
        return Evaluation(COSTS.predicted_speedup(counts, spec), counts.accepted / counts.drafted, 36 / counts.rounds, counts)

    drafts = [DraftSpec(SkipPlan(4), DraftOptions(ngram=n, copy_tokens=c, model_draft=False), k=1)
              for n in (2, 3, 4, 8) for c in (5, 10)]
    enqueue_warm_starts(study, space, drafts)
    run_search(study, space, objective, n_trials=8)
    assert {space.spec_of(t.params).key for t in study.trials} == {d.key for d in drafts}
    tops = top_drafts(study, space, 3, costs=COSTS)
    assert len(tops) == 2  # two behaviours: up to 5 or up to 10 tokens
    assert {r.spec.options.copy_tokens for r in tops} == {5, 10}
    for r in tops:
        assert len(r.twins) == 3
        assert {t.options.copy_tokens for t in r.twins} == {r.spec.options.copy_tokens}
        assert {t.options.ngram for t in r.twins} | {r.spec.options.ngram} == {2, 3, 4, 8}
    assert len(top_drafts(study, space, 3)) == 3  # without a cost model: distinct drafts only


def test_budget_enforced(tmp_path, simulator):
    space = SearchSpace(4, min_skipped=2, max_skipped=3, protect_first_last=False,
                        dims=DraftDims(group_size=(32,), head_ids=("lowest",)))
    study = open_study(tmp_path / "s.db", "b", "tiny", "random", 0)
    run_search(study, space, PredictedObjective(simulator, COSTS), n_trials=25)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert complete and all(2 <= t.user_attrs["n_skipped"] <= 3 for t in complete)
    assert finished(study) == 25


@pytest.mark.parametrize("kwargs", [dict(min_skipped=7, protect_first_last=True), dict(min_skipped=3, max_skipped=2)])
def test_budget_that_allows_no_plan(kwargs):
    with pytest.raises(SelfSpecError, match="allows no plan"):
        SearchSpace(4, **kwargs).check()


def test_enqueued_drafts_run_first(tmp_path, simulator):
    space = SearchSpace(4, dims=DraftDims(group_size=(32,), head_ids=("lowest",)))
    warm = [DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(weights="int8"), k=2),
            DraftSpec(SkipPlan(4, mlp=(1, 2)), DraftOptions(ngram=2, copy_tokens=10), k=3)]
    study = open_study(tmp_path / "s.db", "w", "tiny", "tpe", 0)
    assert enqueue_warm_starts(study, space, warm) == 2
    run_search(study, space, PredictedObjective(simulator, COSTS), n_trials=4)
    trials = study.get_trials()
    assert [space.spec_of(t.params) for t in trials[:2]] == warm
    with pytest.raises(Exception, match="made for a 6-layer"):
        enqueue_warm_starts(open_study(tmp_path / "s2.db", "w2", "tiny", "tpe", 0), space, [DraftSpec(SkipPlan(6))])


def test_a_warm_start_written_before_head_rescoring_takes_the_spaces(capsys):
    from selfspec.search.study import in_head_rescoring, warm_start_params

    space = SearchSpace(4, dims=DraftDims(weights=("int4",), group_size=(32,), head_weights=("model", "int4")))
    older = DraftSpec(SkipPlan(4), DraftOptions(weights="int4", group_size=32, head_weights="int4", ngram=2), k=3)
    with pytest.raises(SelfSpecError, match="head_rescore=0 is outside the space"):  # as it is: refused
        warm_start_params(space, [older])
    (params,) = warm_start_params(space, [in_head_rescoring(space, older)])  # as the search reads it
    assert space.spec_of(params) == older.replace(options=DraftOptions(weights="int4", group_size=32,
                                                                       head_weights="int4", ngram=2, head_rescore=8))
    assert "head_rescore=0 is not in search.space.head_rescore=[8]; it starts with 8" in capsys.readouterr().err
    plain = DraftSpec(SkipPlan(4), DraftOptions(weights="int4", group_size=32), k=3)  # the model's head: as it is
    assert in_head_rescoring(space, plain) == plain and not capsys.readouterr().err
    both = SearchSpace(4, dims=replace(space.dims, head_rescore=(0, 8)))
    assert in_head_rescoring(both, older) == older  # a space that holds 0 keeps it


def test_anchors_are_generic_drafts_the_space_holds(tmp_path, simulator):
    """A new study runs the anchors first: the cheapest skip-free model draft with copies and a copy-only
    draft, each within the space; a space that cannot hold one (a skip budget, no copying, a pure
    layer-skip search) drops it rather than run a draft outside the space or one that saves nothing."""
    space = SearchSpace(6)
    free, copy = space.anchors()
    assert free.plan.n_skipped == 0 and free.options.weights == "int4" and free.options.model_draft
    assert free.options.ngram and free.options.head_weights == "int4"
    assert not copy.options.model_draft and copy.options.ngram
    for a in (free, copy):
        assert space.spec_of(space.params_of(a)) == a
    low = SearchSpace(6, dims=DraftDims(weights=("model", "int8"), head_weights=("model",)))
    assert low.anchors()[0].options.weights == "int8"  # the cheapest precision the space holds
    assert SearchSpace(6, min_skipped=2).anchors() == []  # skipping nothing (copy-only too) is outside the budget
    assert SearchSpace(6, dims=DraftDims(model_draft=(True,))).anchors() == [free]
    papers = SearchSpace(6, dims=DraftDims(weights=("model",), head_weights=("model",), ngram=(0,)))
    assert papers.anchors() == []  # a full-depth, full-precision draft that copies nothing saves nothing
    tiny = SearchSpace(4, dims=DraftDims(group_size=(32,), head_ids=("lowest",)))
    study = open_study(tmp_path / "s.db", "a", "tiny", "tpe", 0)
    assert enqueue_warm_starts(study, tiny, tiny.anchors()) == 2
    run_search(study, tiny, PredictedObjective(simulator, COSTS), n_trials=3)
    assert [tiny.spec_of(t.params) for t in study.get_trials()[:2]] == tiny.anchors()


def test_interrupted_search_resumes_with_no_trial_lost(tmp_path, simulator):
    space = SearchSpace(4, dims=DraftDims(group_size=(32,), head_ids=("lowest",)))
    obj = PredictedObjective(simulator, COSTS)
    study = open_study(tmp_path / "s.db", "r", "tiny", "tpe", 0)

    def stop_after_three(study, trial):
        if trial.number == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_search(study, space, obj, n_trials=10, callbacks=[stop_after_three])
    first = [(t.number, t.params) for t in study.get_trials()]
    assert len(first) == 3
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = study.ask()  # a trial left RUNNING by a worker on this host that was killed
    left.set_user_attr("worker", f"{socket.gethostname()}:{int(gone.stdout)}")
    study.ask()  # one asked by a worker killed before its heartbeat started: no worker recorded, none alive
    live = study.ask()  # and one of a live worker (this process): it is left alone
    live.set_user_attr("worker", workers.WORKER)
    resumed = open_study(tmp_path / "s.db", "r", "tiny", "tpe", 0)
    assert [t.number for t in resumed.get_trials(states=(optuna.trial.TrialState.RUNNING,))] == [live.number]
    resumed.tell(live, state=optuna.trial.TrialState.FAIL)
    run_search(resumed, space, obj, n_trials=10)
    assert finished(resumed) == 10
    assert [(t.number, t.params) for t in resumed.get_trials()][:3] == first


def test_study_reused_with_another_model(tmp_path):
    open_study(tmp_path / "s.db", "x", "model-a", "tpe", 0)
    with pytest.raises(SelfSpecError, match="made for model 'model-a'"):
        open_study(tmp_path / "s.db", "x", "model-b", "tpe", 0)


def test_storage_not_writable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(SelfSpecError, match="cannot write the study storage"):
        open_study(blocker / "sub" / "s.db", "x", "m", "tpe", 0)


def test_unknown_sampler(tmp_path):
    with pytest.raises(SelfSpecError, match="unknown sampler"):
        open_study(tmp_path / "s.db", "x", "m", "nope", 0)
