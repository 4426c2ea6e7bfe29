"""The plan search: deterministic objective, budget, warm starts, resume, CLI end to end."""

import os
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest

from selfspec import SelfSpecError, SkipPlan
from selfspec.assets.tiny import TINY_VOCAB, tiny_model
from selfspec.search.costs import CostModel
from selfspec.search.scoring import AgreementScorer, tokens_per_round
from selfspec.search.space import SearchSpace
from selfspec.search.study import (
    PredictedObjective,
    enqueue_warm_starts,
    finished,
    open_study,
    run_search,
)

PROMPTS = [[5, 9, 12, 40, 41, 7], [8, 8, 30, 2 + 4, 77, 100, 3]]
COSTS = CostModel(t_full=1.0, t_attn=0.01, t_mlp=0.02, t_verify={k: 1.0 + 0.01 * k for k in range(2, 6)}, num_layers=4)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def scorer(tiny):
    return AgreementScorer(tiny, PROMPTS, n_tokens=12, k_max=4)


def test_tokens_per_round():
    assert tokens_per_round([True, True, False, True], 2) == pytest.approx(1 + (2 + 1 + 0 + 1) / 4)
    assert tokens_per_round([True] * 4, 8) == pytest.approx(1 + (4 + 3 + 2 + 1) / 4)
    assert tokens_per_round([], 3) == 1.0


def test_objective_is_deterministic_for_a_plan(tiny, scorer):
    plan = SkipPlan(4, attn=(1,), mlp=(2,))
    obj = PredictedObjective(scorer, COSTS)
    a, b = obj(plan), obj(plan)
    fresh = PredictedObjective(AgreementScorer(tiny, PROMPTS, n_tokens=12, k_max=4), COSTS)(plan)
    assert (a.value, a.k, a.agreement) == (b.value, b.k, b.agreement) == (fresh.value, fresh.k, fresh.agreement)
    empty = scorer.score(SkipPlan(4))
    assert empty.agreement == 1.0  # fp32: the full model agrees with its own continuation


def test_predicted_speedup_formula():
    from selfspec.search.scoring import PlanScore

    plan = SkipPlan(4, attn=(1, 2), mlp=(1,))
    score = PlanScore(agreement=0.5, tokens_per_round={1: 1.5, 2: 1.8})
    t_draft = 1.0 - 2 * 0.01 - 0.02
    want = max((1.5 / (1 * t_draft + COSTS.t_verify[2]), 1), (1.8 / (2 * t_draft + COSTS.t_verify[3]), 2))
    assert COSTS.predicted_speedup(plan, score) == pytest.approx(want)


def test_budget_enforced(tmp_path, scorer):
    space = SearchSpace(4, min_skipped=2, max_skipped=3, protect_first_last=False)
    study = open_study(tmp_path / "s.db", "b", "tiny", "random", 0)
    run_search(study, space, PredictedObjective(scorer, COSTS), n_trials=25)
    complete = study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    assert complete and all(2 <= t.user_attrs["n_skipped"] <= 3 for t in complete)
    assert finished(study) == 25


@pytest.mark.parametrize("kwargs", [dict(min_skipped=7, protect_first_last=True), dict(min_skipped=3, max_skipped=2)])
def test_budget_that_allows_no_plan(kwargs):
    with pytest.raises(SelfSpecError, match="allows no plan"):
        SearchSpace(4, **kwargs).check()


def test_enqueued_plans_run_first(tmp_path, scorer):
    space = SearchSpace(4)
    warm = [SkipPlan(4, attn=(1,)), SkipPlan(4, mlp=(1, 2))]
    study = open_study(tmp_path / "s.db", "w", "tiny", "tpe", 0)
    assert enqueue_warm_starts(study, space, warm) == 2
    run_search(study, space, PredictedObjective(scorer, COSTS), n_trials=4)
    trials = study.get_trials()
    assert [space.plan_of(t.params) for t in trials[:2]] == [SkipPlan(4, attn=(1,)), SkipPlan(4, mlp=(1, 2))]
    with pytest.raises(Exception, match="made for a 6-layer"):
        enqueue_warm_starts(open_study(tmp_path / "s2.db", "w2", "tiny", "tpe", 0), space, [SkipPlan(6)])


def test_interrupted_search_resumes_with_no_trial_lost(tmp_path, scorer):
    space = SearchSpace(4)
    obj = PredictedObjective(scorer, COSTS)
    study = open_study(tmp_path / "s.db", "r", "tiny", "tpe", 0)

    def stop_after_three(study, trial):
        if trial.number == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_search(study, space, obj, n_trials=10, callbacks=[stop_after_three])
    first = [(t.number, t.params) for t in study.get_trials()]
    assert len(first) == 3
    study.ask()  # a trial left RUNNING, as a kill -9 would leave it
    resumed = open_study(tmp_path / "s.db", "r", "tiny", "tpe", 0)
    assert not resumed.get_trials(states=(optuna.trial.TrialState.RUNNING,))
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


def _cli(tmp_path, *overrides, **kw):
    env = {**os.environ, "WANDB_SILENT": "true"}
    args = [sys.executable, "-m", "selfspec.search", "model=tiny-llama", "search=quick",
            f"search.storage={tmp_path}/optuna/study.db", f"plans_dir={tmp_path}/plans",
            f"hydra.run.dir={tmp_path}/hydra", *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def test_cli_end_to_end_with_offline_wandb(tmp_path):
    proc = _cli(tmp_path, "logger=wandb", f"logger.dir={tmp_path}/wandb")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "best plan" in out and "measured" in out
    plan_file = tmp_path / "plans" / "tiny-llama-default.json"
    plan = SkipPlan.load(plan_file)
    assert plan.num_layers == 4 and plan.n_skipped >= 1
    prov = plan.provenance
    assert prov["model"] == "tiny-llama" and "measured_speedup" in prov and "versions" in prov
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1


def test_cli_killed_midway_resumes(tmp_path):
    db = tmp_path / "optuna" / "study.db"
    proc = _cli(tmp_path, "logger=none", "search.n_trials=400", start_new_session=True)
    deadline = time.time() + 120
    done = 0
    while time.time() < deadline and done < 5:
        time.sleep(0.5)
        if db.exists():
            try:
                with sqlite3.connect(db) as con:
                    done = con.execute("select count(*) from trials where state='COMPLETE'").fetchone()[0]
            except sqlite3.OperationalError:
                pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert done >= 5, "the search never got going"
    proc = _cli(tmp_path, "logger=none", "search.n_trials=40")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    study = optuna.load_study(study_name="tiny-llama-default", storage=f"sqlite:///{db}")
    assert finished(study) >= 40
    assert "trials      " in out


def test_cli_bad_input(tmp_path):
    proc = _cli(tmp_path, "logger=none", "search.min_skipped=99")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "error: the search budget allows no plan" in err
    proc = _cli(tmp_path, "logger=none", "dataset=no-such-set")
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "no-such-set" in err


def test_resume_with_other_calibration_refused(tmp_path):
    proc = _cli(tmp_path, "logger=none", "search.n_trials=2")
    assert proc.wait(timeout=300) == 0
    proc = _cli(tmp_path, "logger=none", "search.n_trials=3", "search.calibration_tokens=10")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "other calibration prompts or settings" in err
