"""python -m selfspec.search on a tiny model: end to end with W&B, resumes, several workers and Ctrl-C as their own
processes; refusals of bad input and of a resume under other settings in this process."""

import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pytest

from selfspec.cli.search import main as search_main
from selfspec.draft.spec import DraftSpec
from selfspec.search import workers
from selfspec.search.costs import COST_MODEL_VERSION
from selfspec.search.space import DraftDims, SearchSpace
from selfspec.search.study import finished, open_study
from tests.helpers import run_main


def _cli(tmp_path, *overrides, **kw):
    env = {**os.environ, "WANDB_SILENT": "true"}
    args = [sys.executable, "-m", "selfspec.search", "model=tiny-llama", "search=quick",
            f"search.storage={tmp_path}/optuna/study.db", f"plans_dir={tmp_path}/plans",
            f"hydra.run.dir={tmp_path}/hydra", *overrides]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _run(tmp_path, *overrides, capsys=None) -> subprocess.CompletedProcess:
    """What `_cli` starts, in this process."""
    return run_main(search_main, "model=tiny-llama", "search=quick", f"search.storage={tmp_path}/optuna/study.db",
                    f"plans_dir={tmp_path}/plans", f"hydra.run.dir={tmp_path}/hydra", *overrides, capsys=capsys)


def _study(tmp_path):
    return optuna.load_study(study_name="tiny-llama-default", storage=f"sqlite:///{tmp_path}/optuna/study.db")


@pytest.fixture(scope="module")
def two_trial_study(tmp_path_factory):
    """One finished 2-trial search, shared by the tests that resume it (each on its own copy)."""
    base = tmp_path_factory.mktemp("two_trial_study")
    assert _run(base, "logger=none", "search.n_trials=2").returncode == 0
    return base / "optuna" / "study.db"


@pytest.fixture
def resumable(tmp_path, two_trial_study):
    """This test's own copy of the shared 2-trial study, where `_cli(tmp_path, ...)` finds it."""
    (tmp_path / "optuna").mkdir()
    shutil.copyfile(two_trial_study, tmp_path / "optuna" / "study.db")
    assert finished(_study(tmp_path)) == 2
    return tmp_path


@pytest.fixture
def quick_study(tmp_path, tiny_study):
    """This test's own copy of the shared quick search's study (conftest), where `_run(tmp_path, ...)` finds it."""
    (tmp_path / "optuna").mkdir()
    shutil.copyfile(tiny_study, tmp_path / "optuna" / "study.db")
    return tmp_path


@pytest.mark.cli
def test_cli_end_to_end_with_offline_wandb(tmp_path):
    proc = _cli(tmp_path, "logger=wandb", f"logger.dir={tmp_path}/wandb", "search.time_target_s=1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "best draft" in out and "measured" in out
    time_line = next(line for line in out.splitlines() if line.startswith("time  "))
    for stage in ("calibration and cost model", "trials", "re-timing", "held-out check", "s before it (prompts"):
        assert stage in time_line, time_line
    over = next(line for line in out.splitlines() if line.startswith("note: ") and "s target" in line)
    assert "over the 1 s target (search.time_target_s)" in over and "one full-model step" in over, over
    chunks = next(line for line in out.splitlines() if line.startswith("chunks  "))
    assert " teacher-forced draft chunks run" in chunks and " answered from memory" in chunks, chunks
    # the re-timed candidates include the best draft with no sublayer skipped (its options alone; a copy-only
    # draft skips none)
    retimed = out[out.index("re-timed candidates:"):].splitlines()[1:]
    assert any("(0 of 8 sublayers)" in line or line.startswith("  copy only") for line in retimed
               if line.startswith("  ")), out
    spec = DraftSpec.load(tmp_path / "plans" / "tiny-llama-default.json")
    assert spec.plan.num_layers == 4 and spec.k in (1, 2, 3)
    prov = spec.plan.provenance
    assert prov["model"] == "tiny-llama" and "versions" in prov and prov["cost_model"]["machine"]["cpu"]
    assert {"calibration", "heldout", "predicted_speedup"} <= set(spec.measured)
    assert spec.measured["calibration"]["measured"]["speedup"] > 0
    runs = list((tmp_path / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    study = optuna.load_study(study_name="tiny-llama-default", storage=f"sqlite:///{tmp_path}/optuna/study.db")
    quick = SearchSpace(4, dims=DraftDims(k=(1, 2, 3), head_tokens=(0,), group_size=(32,)))
    assert [quick.spec_of(t.params) for t in study.trials[:2]] == quick.anchors()  # search.anchors: on by default


@pytest.mark.cli
def test_predictions_beside_measurements_replay_the_timed_runs_exactly_in_fp64(tmp_path):
    # the report sets each prediction beside a measurement of the same prompts and continuations: in fp64
    # the simulated rounds are the real ones, so acceptance and tokens per round agree to rounding
    proc = _cli(tmp_path, "logger=none", "model.dtype=float64", "search.ablation=true", "search.retime.prompts=2",
                "search.retime.max_new_tokens=48", "search.heldout.max_new_tokens=48",
                "search.space.weights=[model]", "search.space.head_weights=[model]",  # no int8/int4 in fp64
                "search.space.ngram=[2]", "search.space.min_ngram=[1]",
                # what a draft proposes after its first miss is simulated on the target's tokens, not its own: the
                # drafted count is exact for fixed-k chains and copy trees, an estimate for an adaptive exit or a
                # tree that branches where the draft is unsure (selfspec.search.simulate), so those are left out
                "search.space.adaptive=[false]", "search.space.branch_below=[0.0]")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    measured = DraftSpec.load(tmp_path / "plans" / "tiny-llama-default.json").measured
    pairs = [measured["calibration"], measured["heldout"], *measured["ablation"]]
    assert len(pairs) >= 4
    for pair in pairs:
        p, m = pair["predicted"], pair["measured"]
        assert p["tokens_per_round"] == pytest.approx(m["tokens_per_round"], abs=1e-9), pair
        assert p["acceptance"] == pytest.approx(m["acceptance"], abs=1e-9, nan_ok=True), pair
    assert sum(pair["measured"]["tokens_per_round"] > 1.0 for pair in pairs) >= 2  # some rounds accepted copies
    assert "on the timed prompts" in out


@pytest.mark.cli
def test_cli_killed_midway_resumes(tmp_path):
    db = tmp_path / "optuna" / "study.db"
    proc = _cli(tmp_path, "logger=none", "search.n_trials=400", start_new_session=True)
    deadline = time.time() + 120
    done = 0
    while time.time() < deadline and done < 5 and proc.poll() is None:
        time.sleep(0.5)
        if db.exists():
            try:
                with sqlite3.connect(db) as con:
                    done = con.execute("select count(*) from trials where state='COMPLETE'").fetchone()[0]
            except sqlite3.OperationalError:
                pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    _, err = proc.communicate()
    assert done >= 5, f"the search never got going:\n{err[-3000:]}"
    proc = _cli(tmp_path, "logger=none", "search.n_trials=40")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    study = optuna.load_study(study_name="tiny-llama-default", storage=f"sqlite:///{db}")
    assert finished(study) >= 40
    assert "trials      " in out


def test_cli_bad_input(tmp_path, capsys):
    proc = _run(tmp_path, "logger=none", "search.min_skipped=99", capsys=capsys)
    assert proc.returncode == 2 and "error: the search budget allows no plan" in proc.stderr
    proc = _run(tmp_path, "logger=none", "dataset=no-such-set", capsys=capsys)
    assert proc.returncode != 0 and "no-such-set" in proc.stderr


def test_resume_with_other_calibration_refused(quick_study, capsys):
    proc = _run(quick_study, "logger=none", "search.n_trials=3", "search.calibration_tokens=10", capsys=capsys)
    assert proc.returncode == 2 and "other calibration prompts or settings" in proc.stderr


@pytest.mark.cli
def test_cli_remeasures_costs_on_another_machine_and_says_so(resumable):
    tmp_path = resumable
    study = _study(tmp_path)
    saved = study.user_attrs["calibration_data"]
    saved["costs"]["machine"]["cpu"] = "another CPU"
    study.set_user_attr("calibration_data", saved)
    out, err = _cli(tmp_path, "logger=none", "search.n_trials=3").communicate(timeout=300)
    assert "cost model re-measured on this machine" in out and "another CPU" in out, err
    assert _study(tmp_path).user_attrs["calibration_data"]["costs"]["machine"]["cpu"] != "another CPU"
    # a cost model measured on this machine the way an older selfspec measured it (version 1) is measured again
    study = _study(tmp_path)
    saved = study.user_attrs["calibration_data"]
    del saved["costs"]["version"]
    study.set_user_attr("calibration_data", saved)
    out, err = _cli(tmp_path, "logger=none", "search.n_trials=3").communicate(timeout=300)
    assert "measuring the cost model" in err and "version 1" in out, err
    assert _study(tmp_path).user_attrs["calibration_data"]["costs"]["version"] == COST_MODEL_VERSION


@pytest.mark.cli
def test_a_torn_calibration_file_of_an_older_study_is_calibrated_again(resumable):
    tmp_path = resumable
    study = _study(tmp_path)  # as an older selfspec left it: the calibration in a file beside the study
    saved = study.user_attrs["calibration_data"]
    study.set_user_attr("calibration_data", None)
    legacy = tmp_path / "optuna" / "study.calibration.json"
    legacy.write_text(json.dumps(saved))
    _, err = _cli(tmp_path, "logger=none", "search.n_trials=3").communicate(timeout=300)
    assert "calibrating" not in err and "measuring the cost model" not in err, err  # the file was taken as it is
    study.set_user_attr("calibration_data", None)
    legacy.write_text(json.dumps(saved)[:50])
    p = _cli(tmp_path, "logger=none", "search.n_trials=4")
    _, err = p.communicate(timeout=300)
    assert p.returncode == 0 and "unreadable (torn?); calibrating again" in err, err
    assert _study(tmp_path).user_attrs["calibration_data"]["continuations"] == saved["continuations"]


@pytest.mark.parametrize("override, message", [
    ("search.max_skipped=2", "searched another space"),
    ("search.objective=wallclock", "was scored by objective")])
def test_cli_refuses_to_resume_under_other_scoring_settings(quick_study, capsys, override, message):
    proc = _run(quick_study, "logger=none", "search.n_trials=3", override, capsys=capsys)
    assert proc.returncode == 2 and message in proc.stderr


def test_a_study_of_the_older_format_is_refused(tmp_path, capsys):
    study = open_study(tmp_path / "optuna" / "study.db", "tiny-llama-default", "tiny-llama", "tpe", 0)
    study.enqueue_trial({"attn_1": 1})
    study.tell(study.ask(), 1.0)
    proc = _run(tmp_path, "logger=none", "search.n_trials=3", capsys=capsys)
    assert proc.returncode == 2 and "made by an older selfspec" in proc.stderr


@pytest.mark.cli
@pytest.mark.parametrize("storage", ["study.db", pytest.param("study.journal", marks=pytest.mark.slow)])
def test_two_workers_share_one_study(tmp_path, storage):
    """Two search processes on one study: one calibration, the budget kept, one draft written."""
    common = ["logger=none", "search.n_trials=24", f"search.storage={tmp_path}/optuna/{storage}"]
    procs = [_cli(tmp_path, *common, f"hydra.run.dir={tmp_path}/hydra{i}") for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    err = "".join(e for _, e in outs)
    assert err.count("calibrating:") == 1 and err.count("measuring the cost model") == 1, err
    assert sum("best draft" in o for o, _ in outs) == 1 and err.count("worker") >= 1
    store = workers.open_storage(tmp_path / "optuna" / storage)
    study = optuna.load_study(study_name="tiny-llama-default", storage=store)
    assert finished(study) == 24
    unrun = study.get_trials(states=(optuna.trial.TrialState.FAIL,))
    assert len(unrun) <= 1 and all("not_run" in t.user_attrs for t in unrun)
    assert DraftSpec.load(tmp_path / "plans" / "tiny-llama-default.json").plan.num_layers == 4
    assert optuna.get_all_study_names(store) == ["tiny-llama-default"]  # slots and claims given back


@pytest.mark.cli
def test_ctrl_c_during_the_search_is_one_clean_message(tmp_path):
    db = tmp_path / "optuna" / "study.db"
    # So many trials that the search cannot end on its own before the signal.
    # A user's Ctrl-C reaches a foreground program. A test run started in the background (CI, nohup, `&` in a
    # script) ignores SIGINT, and the child would inherit that: give it back the default, as a terminal would.
    proc = _cli(tmp_path, "logger=none", "search.n_trials=100000",
                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline, done = time.time() + 120, 0
    while time.time() < deadline and done < 3:
        time.sleep(0.3)
        try:
            with sqlite3.connect(db) as con:
                done = con.execute("select count(*) from trials where state='COMPLETE'").fetchone()[0]
        except sqlite3.OperationalError:
            pass
    assert proc.poll() is None, "the search ended before it could be interrupted"
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted: finished trials are saved" in err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]


def test_a_misspelt_new_key_is_refused(tmp_path, capsys):
    p = _run(tmp_path, "logger=none", "+serch.n_trials=3", capsys=capsys)
    assert p.returncode == 2 and "search has no 'serch' (did you mean search?)" in p.stderr
