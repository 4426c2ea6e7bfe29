"""Faults injected while a job runs: full disks, folders made read-only, broken files, signals.

Each gives one clear line (or a clean stop that says what was kept and how to resume), and what was written
before the fault stays valid and resumes without duplicates. Runs as root ignore file modes, so a read-only
folder is a tmpfs mounted read-only (skipped where mounting is not allowed) or a writer patched to fail.
"""

import errno
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml

from selfspec import DecodeConfig, SelfSpecError, SkipPlan
from selfspec.assets.data import load_task_set, prompt_set_from_config
from selfspec.assets.models import load_model
from selfspec.cli.config import conf_dir, group_option
from selfspec.cli.jobs import write_failure
from selfspec.eval import runner
from selfspec.eval.methods import build_method
from selfspec.eval.records import read_jsonl
from selfspec.provenance import append_lines
from selfspec.search.settings import SearchSettings
from selfspec.typed import typed
from tests.helpers import ROOT, run_main


def _full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def read_only():
    """``read_only(path)`` makes one existing file read-only (a read-only bind mount of it) until the test ends."""
    mounted = []

    def make(path: Path) -> None:
        for cmd in (["mount", "--bind", str(path), str(path)], ["mount", "-o", "remount,ro,bind", str(path)]):
            if subprocess.run(cmd, capture_output=True).returncode:
                pytest.skip("this machine does not allow mounts (needed for a read-only file under root)")
            mounted.append(path)

    yield make
    for path in dict.fromkeys(reversed(mounted)):
        subprocess.run(["umount", str(path)], capture_output=True)


# -- writers ------------------------------------------------------------------------------------------------------

def test_a_full_disk_mid_line_leaves_whole_lines_and_names_the_file(tmp_path, monkeypatch):
    path = tmp_path / "samples.jsonl"
    append_lines(path, [{"a": 1}])
    real = os.write

    def half_then_full(fd, data):  # a disk that takes half the line, then is full
        if len(data) > 8:
            return real(fd, bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as e:
        append_lines(path, [{"b": "x" * 40}])
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    assert path.read_text() == '{"a": 1}\n'  # the half line was cut again
    assert write_failure(e.value) == f"cannot write {path}: No space left on device"


def test_write_failures_are_named_for_files_and_study_storages():
    assert write_failure(OSError(errno.EROFS, "Read-only file system", "/r/x.json")) == \
        "cannot write /r/x.json: Read-only file system"
    assert write_failure(ValueError("a bug")) is None  # not a write failure: the traceback stays
    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as inner:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from inner
    except optuna.exceptions.StorageInternalError as e:
        assert write_failure(e) == "the study's storage could not write: database or disk is full"


# -- an evaluation ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", dtype="float32")


def _evaluate(lm, tasks, path, n=3):
    cfg = DecodeConfig(max_new_tokens=4)
    plan = SkipPlan(lm.num_layers, attn=[1], model=lm.name)
    methods = [build_method(m, lm, cfg, plan if m == "self_speculative" else None)
               for m in ("autoregressive", "self_speculative")]
    return runner.evaluate(lm, tasks, methods, runner.EvalSettings(path, n_samples=n, warmup_tokens=1),
                           {"model": lm.name})


def test_an_evaluation_stopped_by_a_full_disk_resumes_without_duplicates(lm, tmp_path, monkeypatch):
    tasks = load_task_set(yaml.safe_load((conf_dir() / "dataset" / "tiny.yaml").read_text()))
    path = tmp_path / "samples.jsonl"
    calls = []

    def fails_on_the_second_sample(p, rows):
        calls.append(p)
        if len(calls) == 2:
            _full()
        append_lines(p, rows)

    monkeypatch.setattr(runner, "append_lines", fails_on_the_second_sample)
    with pytest.raises(OSError):
        _evaluate(lm, tasks, path)
    monkeypatch.undo()
    _, kept = read_jsonl(path)
    assert {r["sample_id"] for r in kept} == {tasks.eval[0].id} and len(kept) == 2  # the first sample, whole
    rows = _evaluate(lm, tasks, path)
    assert len(rows) == 6 and len({(r["sample_id"], r["method"]) for r in rows}) == 6


def test_an_evaluation_whose_samples_are_all_skipped_fails(lm, tmp_path):
    from selfspec.assets.data import Sample, TaskSet

    empty = TaskSet("empty", (), (Sample("a", ("",)), Sample("b", ("  ",))), 4)
    with pytest.raises(SelfSpecError, match="every one of the 2 samples was skipped"):
        _evaluate(lm, empty, tmp_path / "samples.jsonl", n=2)


@pytest.mark.cli
def test_an_evaluation_whose_results_file_turns_read_only_stops_cleanly_and_resumes(read_only, tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, str(ROOT / "experiments" / "evaluate.py"), "model=tiny-llama", "dataset=tiny",
            "logger=none", "plan=empty", "decoding.max_new_tokens=4", "warmup_tokens=1", f"hydra.run.dir={run}"]
    first = subprocess.run(args + ["n_samples=1"], capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    read_only(run / "samples.jsonl")
    stopped = subprocess.run(args + ["n_samples=3"], capture_output=True, text=True, cwd=tmp_path)
    assert stopped.returncode == 2 and "Traceback" not in stopped.stderr, stopped.stderr[-2000:]
    line = stopped.stderr.strip().splitlines()[-1]
    assert f"cannot write {run / 'samples.jsonl'}: Read-only file system" in line and "rerun the same command" in line
    subprocess.run(["umount", str(run / "samples.jsonl")], check=True)
    resumed = subprocess.run(args + ["n_samples=3"], capture_output=True, text=True, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _, rows = read_jsonl(run / "samples.jsonl")
    assert len(rows) == 6 and len({(r["sample_id"], r["method"]) for r in rows}) == 6


# -- a search -----------------------------------------------------------------------------------------------------

def _quick(tmp_path, **over) -> SearchSettings:
    quick = yaml.safe_load((conf_dir() / "search" / "quick.yaml").read_text())
    quick.pop("defaults")
    return typed(SearchSettings, {**quick, "storage": str(tmp_path / "s.db"), "plans_dir": str(tmp_path / "plans"),
                                  "study_name": "q", "n_trials": 3, "anchors": False, "heldout": {"prompts": 0},
                                  "retime": {"top_n": 1, "reps": 1, "prompts": 1, "max_new_tokens": 4}, **over},
                 "search")


def test_a_draft_that_cannot_be_written_at_the_last_step_still_reaches_the_report(lm, tmp_path, monkeypatch):
    from selfspec.draft.spec import DraftSpec
    from selfspec.search.pipeline import search
    from selfspec.search.report import format_report

    monkeypatch.setattr(DraftSpec, "save", lambda self, path: _full())
    report = search(lm, prompt_set_from_config(group_option("dataset", "tiny")), _quick(tmp_path))
    assert report.plan_path == "" and "No space left on device" in report.unsaved
    assert report.draft.plan.num_layers == lm.num_layers  # the whole draft, to print
    assert f"draft not written: {report.unsaved}" in format_report(report)
    assert not list((tmp_path / "plans").glob("*"))  # no half-written file


def test_a_model_with_no_token_ranking_searches_cut_heads_on_their_lowest_ids(lm, tmp_path, capsys, monkeypatch):
    from selfspec.assets import vocab
    from selfspec.search.pipeline import search

    monkeypatch.delattr(lm.model, vocab._ATTR)  # as a model built in-process has none

    space = {"group_size": [32], "head_weights": ["int4"], "head_tokens": [40],
             "head_ids": ["lowest", "frequent"], "k": [2], "model_draft": [True]}
    report = search(lm, prompt_set_from_config(group_option("dataset", "tiny")), _quick(tmp_path, space=space))
    assert "has no token ranking" in capsys.readouterr().err
    assert report.draft.options.head_tokens == 40 and report.draft.options.head_ids == "lowest"


def test_a_refused_warm_start_leaves_no_study_behind(lm, tmp_path):
    from selfspec.draft.spec import DraftSpec
    from selfspec.search.pipeline import search

    other = DraftSpec(SkipPlan(lm.num_layers + 2)).save(tmp_path / "other.json")
    with pytest.raises(SelfSpecError, match="layer"):
        search(lm, prompt_set_from_config(group_option("dataset", "tiny")), _quick(tmp_path, warm_start=[str(other)]))
    assert not (tmp_path / "s.db").exists()


def test_a_dead_workers_slot_is_cleared_when_the_next_worker_starts(tmp_path):
    from selfspec.search.workers import _MARK, open_storage, worker_slot

    storage = open_storage(tmp_path / "s.journal")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for slot in (0, 1):
        marker = optuna.create_study(study_name=f"q{_MARK}worker-{slot}", storage=storage)
        marker.set_user_attr("worker", f"{os.uname().nodename}:{dead.pid}")
    with worker_slot(storage, "q") as slot:
        names = {s.study_name for s in storage.get_all_studies()}
        assert slot == 0 and names == {f"q{_MARK}worker-0"}  # slot 1 of the dead worker is gone too
    assert not storage.get_all_studies()


def test_a_garbage_line_in_a_journal_study_names_the_file_and_line(tmp_path):
    from selfspec.search.workers import open_storage

    path = tmp_path / "s.journal"
    study = optuna.create_study(study_name="q", storage=open_storage(path))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:2] + ["not a record\n"] + lines[2:]))
    with pytest.raises(SelfSpecError, match=r"s\.journal, line 3 is not a journal record: 'not a record'"):
        open_storage(path)


# -- inputs and environments --------------------------------------------------------------------------------------

@pytest.mark.parametrize("content, where", [(b'{"text": "a"}\n{"text": "b\xff"}\n', "line 2: byte 0xff is not UTF-8"),
                                            (b'{"text": "a"}\n\n{"text": b}\n', "line 3: not a JSON line"),
                                            (b'[{"text": "a"}, {"text": }]', "line 1: not valid JSON")])
def test_a_broken_json_dataset_names_the_file_and_line(tmp_path, content, where):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content)
    with pytest.raises(SelfSpecError, match=f"rows.jsonl, {where}"):
        load_task_set({"name": "mine", "source": "json", "path": str(path), "format": "plain"})


@pytest.mark.parametrize("key, value, kind", [("temperature", "abc", "a number"), ("k", 1.5, "an integer"),
                                              ("packed_weights", "yes", "true or false")])
def test_a_value_of_the_wrong_kind_names_the_key_and_the_value(key, value, kind):
    from omegaconf import OmegaConf

    from selfspec.cli.config import decode_config

    cfg = OmegaConf.create({"decoding": {**yaml.safe_load((conf_dir() / "decoding" / "default.yaml").read_text()),
                                         key: value}})
    with pytest.raises(SelfSpecError, match=f"decoding.{key} must be {kind}, got {value!r}"):
        decode_config(cfg, 8, None)


def test_a_two_part_relative_model_path_fails_at_once_without_the_hub(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.perf_counter()
    with pytest.raises(SelfSpecError, match=r"no model 'mymodels/smol'.*\./mymodels/smol"):
        load_model("mymodels/smol")
    assert time.perf_counter() - t < 20  # (no retries; the bound only guards against a hang)


def test_generate_refuses_another_models_draft_of_the_same_depth(tmp_path, capsys):
    from selfspec.cli.generate import main
    from selfspec.draft.spec import DraftSpec

    lm = load_model("tiny-qwen2", dtype="float32")
    other = DraftSpec(SkipPlan(lm.num_layers, attn=(1,), model="tiny-llama")).save(tmp_path / "d.json")
    assert main(["--model", "tiny-qwen2", "--plan", str(other), "--max-new-tokens", "4"]) == 2
    assert "made for model 'tiny-llama', not 'tiny-qwen2'" in capsys.readouterr().err


def test_a_read_only_kernel_cache_loads_a_current_build_and_says_why_it_cannot_build(tmp_path, monkeypatch):
    import torch

    from selfspec.kernels import vnni

    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(vnni, "check_writable", lambda folder, what: (_ for _ in ()).throw(
        SelfSpecError(f"cannot write {what} at {folder}: Read-only file system")))
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    with pytest.raises(SelfSpecError, match="set SELFSPEC_CACHE to a folder that can be written"):
        vnni.compile_extension(vnni.SOURCE, "int4_vnni", [])  # nothing built there yet
    assert not loaded
    # a read-only copy of a cache that holds this checkout's build
    digest = hashlib.sha256(str(vnni.SOURCE.resolve()).encode()).hexdigest()[:12]
    build = tmp_path / "kernels" / f"int4_vnni-torch{torch.__version__.split('+')[0]}-{digest}"
    build.mkdir(parents=True)
    (build / "selfspec_int4_vnni.so").write_bytes(b"")
    vnni.compile_extension(vnni.SOURCE, "int4_vnni", [])
    assert loaded == [str(build / "selfspec_int4_vnni.so")]


def test_wandb_runs_offline_under_a_read_only_home_and_refuses_online_without_a_key(tmp_path, monkeypatch):
    from selfspec.cli.wandb_logger import WandbLogger

    blocked = tmp_path / "file"
    blocked.write_text("")  # a home below a file: nothing can be made there, as in a read-only home
    monkeypatch.setattr(Path, "home", lambda: blocked / "home")
    monkeypatch.setenv("HOME", str(blocked / "home"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    cfg = {"name": "wandb", "project": "p", "mode": "offline", "dir": str(tmp_path / "wandb")}
    logger = WandbLogger(cfg, "evaluate", {}).start()
    logger.log({"x": 1})
    logger.finish()
    assert os.environ["WANDB_CACHE_DIR"].startswith(str(tmp_path / "wandb"))
    assert list((tmp_path / "wandb").rglob("*.wandb"))  # the offline run was written
    with pytest.raises(SelfSpecError, match="W&B cannot log online .*WANDB_API_KEY.*logger=none"):
        WandbLogger({**cfg, "mode": "online"}, "evaluate", {}).start()


@pytest.mark.cli
def test_ctrl_c_while_an_entry_point_imports_is_a_quiet_stop(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "selfspec.search", "model=tiny-llama", "logger=none",
                          f"hydra.run.dir={tmp_path}/run", f"search.storage={tmp_path}/s.db",
                          f"plans_dir={tmp_path}/plans"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a parent may ignore it
    time.sleep(0.3)  # inside the imports (torch alone takes longer)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert not (tmp_path / "s.db").exists()


def test_a_work_folder_a_failed_fetch_left_is_removed_unless_in_use(tmp_path):
    from selfspec.assets.fetch import remove_if_unused
    from selfspec.locks import waiting

    work = tmp_path / ".m.work"
    work.mkdir()
    with waiting(work / "m.gguf", "fetching"):  # another process's fetch waits on it: it stays
        remove_if_unused(work)
    assert work.is_dir()
    (work / "m.gguf.partial").write_bytes(b"x")  # anything but locks: it stays
    remove_if_unused(work)
    assert work.is_dir()
    (work / "m.gguf.partial").unlink()
    remove_if_unused(work)  # only a lock nobody holds: gone
    assert not work.exists()


@pytest.mark.cli
def test_sigterm_mid_evaluation_is_a_clean_stop_and_the_rerun_resumes(tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, str(ROOT / "experiments" / "evaluate.py"), "model=tiny-llama", "dataset=tiny",
            "logger=none", "plan=empty", "decoding.max_new_tokens=48", "warmup_tokens=1", "n_samples=3",
            f"hydra.run.dir={run}"]
    p = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    samples = run / "samples.jsonl"
    deadline = time.time() + 300
    while p.poll() is None and time.time() < deadline and (
            not samples.is_file() or samples.read_text().count('"sample_id"') < 1):
        time.sleep(0.02)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=300)
    if p.returncode == 0:
        pytest.skip("the run finished before the signal arrived")
    assert p.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "finished samples are saved; rerun the same command to resume" in err
    resumed = subprocess.run(args, capture_output=True, text=True, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    _, rows = read_jsonl(samples)
    assert len(rows) == 6 and len({(r["sample_id"], r["method"]) for r in rows}) == 6


def test_the_search_command_prints_a_draft_it_cannot_write_and_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    from selfspec.cli.search import main as search_main
    from selfspec.draft.spec import DraftSpec

    monkeypatch.setattr(DraftSpec, "save", lambda self, path: _full())
    p = run_main(search_main, "model=tiny-llama", "search=quick", "logger=none", "search.n_trials=3",
                 "search.heldout.prompts=0", "search.ablation=false", f"search.storage={tmp_path}/s.db",
                 f"plans_dir={tmp_path}/plans", f"hydra.run.dir={tmp_path}/run", capsys=capsys)
    assert p.returncode == 2, p.stderr[-2000:]
    assert '"format": "selfspec.draft/2"' in p.stdout and "draft not written" in p.stdout
    assert "No space left on device" in p.stderr and "rerun the same command" in p.stderr and "Traceback" not in p.stderr
