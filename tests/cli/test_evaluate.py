"""python experiments/evaluate.py on a tiny model: a sweep end to end with W&B and the tables, as its own process;
parallel launchers; in this process, failed jobs, variants, splits, run folders and refusals."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from selfspec import SkipPlan
from selfspec.cli.evaluate import main as evaluate_main
from selfspec.eval.tables import load_runs, methods_overview, write_tables
from selfspec.provenance import git_commit
from tests.helpers import ROOT, run_main


def _evaluate(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "evaluate.py"), *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=600)


# runs whose tokens no assertion counts: a few tokens, a short warm-up
SHORT = ("decoding.max_new_tokens=6", "warmup_tokens=2")


def _run(capsys, *args) -> subprocess.CompletedProcess:
    """experiments/evaluate.py with these overrides, in this process."""
    return run_main(evaluate_main, *args, capsys=capsys)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.json"
    SkipPlan(4, attn=(1,), mlp=(2,), model="tiny-llama", provenance={"k": 2}).save(path)
    return path


@pytest.mark.cli
def test_sweep_writes_jsonl_wandb_and_a_table(tmp_path, tiny_plan):
    runs = tmp_path / "runs"
    p = _evaluate("+experiment=smoke", f"plan={tiny_plan}", f"hydra.sweep.dir={runs}/smoke", cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    files = sorted(runs.glob("smoke/tiny-llama/tiny/*/samples.jsonl"))
    assert [f.parent.name for f in files] == ["decoding.k=2", "decoding.k=3"]  # one folder per job
    for f in files:
        lines = [json.loads(l) for l in f.read_text().splitlines()]
        head, rows = lines[0], lines[1:]
        # the checkout's commit, or null where the code runs outside a git checkout
        assert head["type"] == "header" and head["provenance"]["git_commit"] == git_commit(ROOT)
        assert head["provenance"]["config"]["dataset"]["name"] == "tiny"
        assert len(rows) == 3 * 2  # 3 eval samples x 2 methods
        two_turns = [r for r in rows if r["turns"] == 2]
        assert len(two_turns) == 2 and all(len(r["output_text"]) == 2 for r in two_turns)
        spec = [r for r in rows if r["method"] == "self_speculative"]
        assert all(sum(r["counters"]["accepted_per_position"]) == r["counters"]["accepted"] for r in spec)
        assert list(f.parent.glob("wandb/offline-run-*"))  # an offline W&B run in the run folder
        assert json.loads((f.parent / "summary.json").read_text())["autoregressive"]["speedup"] == 1.0
    tables, figures = tmp_path / "tables", tmp_path / "figures"
    p = subprocess.run([sys.executable, "-m", "selfspec.tables", "--runs", str(runs), "--tables", str(tables),
                        "--figures", str(figures), "--studies", str(tmp_path / "none")], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
    assert p.returncode == 0 and "smoke.{md,tex,csv}: 4 rows" in p.stdout, p.stderr[-3000:]
    md = (tables / "smoke.md").read_text()
    assert md.count("| tiny-llama | tiny |") == 4
    assert "- command: `python experiments/evaluate.py +experiment=smoke logger=none`" in md  # its provenance
    tex = (tables / "smoke.tex").read_text()
    assert tex.startswith("% # smoke\n") and "\\begin{tabular}" in tex
    assert (figures / "acceptance_by_position.png").stat().st_size > 0


def test_a_failed_job_does_not_stop_the_sweep_but_sets_its_exit_status(tmp_path, capsys, tiny_plan):
    runs = tmp_path / "runs"
    p = _run(capsys, "-m", "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1", "name=x",
             "decoding.k=0,2", f"hydra.sweep.dir={runs}/x")
    assert p.returncode == 1, p.stderr[-3000:]
    assert "1 job(s) of this sweep failed" in p.stderr and "decoding.k=0: k (draft tokens per round)" in p.stderr
    assert "k (draft tokens per round) must be" in (runs / "x/tiny-llama/tiny/decoding.k=0/FAILED").read_text()
    assert (runs / "x/tiny-llama/tiny/decoding.k=2/samples.jsonl").is_file()
    assert not (runs / "x/tiny-llama/tiny/decoding.k=2/FAILED").exists()
    time.sleep(1.1)  # a sweep counts the failures stamped from 1 s before it started: a rerun comes later than that
    p = _run(capsys, "-m", "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1", "name=x",
             "decoding.k=2", f"hydra.sweep.dir={runs}/x")
    assert p.returncode == 0, p.stderr[-3000:]  # an earlier sweep's failure is not this one's


@pytest.mark.cli
@pytest.mark.parametrize("launcher", ["joblib", pytest.param("submitit_local", marks=pytest.mark.slow)])
def test_sweeps_on_parallel_launchers(tmp_path, tiny_plan, launcher):
    runs = tmp_path / "runs"
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else [
        "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={runs}/x"]
    p = _evaluate("-m", f"hydra/launcher={launcher}", "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}",
                  "logger=none", "name=x", "n_samples=1", "decoding.k=0,2,3", f"hydra.sweep.dir={runs}/x", *extra,
                  cwd=ROOT)
    assert p.returncode == 1 and "1 job(s) of this sweep failed" in p.stderr, p.stderr[-3000:]
    for k in (2, 3):
        job = runs / f"x/tiny-llama/tiny/decoding.k={k}"
        head = json.loads((job / "samples.jsonl").read_text().splitlines()[0])
        threads = max(1, (os.cpu_count() or 1) // 2) if launcher == "joblib" else 1  # cores shared by 2 jobs; or 1 each
        assert head["provenance"]["machine"]["torch_threads"] == threads
        assert (job / ".hydra" / "overrides.yaml").is_file()


@pytest.mark.parametrize("where", ["hydra.run.dir", "logger.dir", "hydra.sweep.dir"])
def test_a_folder_that_cannot_be_written_is_one_line(tmp_path, capsys, tiny_plan, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "n_samples=1", f"{where}={blocker}/sub"]
    if where == "logger.dir":
        args += ["logger=wandb", f"hydra.run.dir={tmp_path / 'run'}"]
    if where == "hydra.sweep.dir":
        args = ["-m", *args, "logger=none"]
    p = _run(capsys, *args)
    assert p.returncode == 2 and "cannot write the" in p.stderr and "Not a directory" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_a_misspelt_new_key_is_refused_not_ignored(tmp_path, capsys, tiny_plan):
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "+decodng.k=2",
             f"hydra.run.dir={tmp_path / 'run'}")
    assert p.returncode == 2 and "evaluate has no 'decodng' (did you mean decoding?)" in p.stderr
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def test_tables_mark_a_failed_partial_run(tmp_path, capsys, tiny_plan):
    runs = tmp_path / "runs"
    run = runs / "x" / "tiny-llama" / "tiny"
    assert _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", *SHORT, "n_samples=1",
                f"hydra.run.dir={run}").returncode == 0
    (run / "FAILED").write_text("killed by a test\n")
    rows = write_tables(load_runs(runs), tmp_path / "tables")["x"]
    assert {r["variant"] for r in rows} == {"default (failed, partial)"}
    assert methods_overview({"x": rows}) == []


def test_packed_only_refuses_the_transformers_methods(tmp_path, capsys, tiny_plan):
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1",
             f"hydra.run.dir={tmp_path / 'run'}", "decoding.packed_only=true",
             "methods=[autoregressive,hf_generate]")
    assert p.returncode == 2 and "packed_only" in p.stderr and "hf_generate" in p.stderr


def test_method_variants_run_side_by_side_with_their_own_options(tmp_path, capsys, tiny_plan):
    run = tmp_path / "run"
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", *SHORT,
             "methods=[autoregressive,self_speculative,self_speculative-tree]",
             "+method_options.self_speculative-tree.ngram=1",
             "+method_options.self_speculative-tree.copy_candidates=3", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    info = lines[0]["fingerprint"]["method_info"]
    assert "self_speculative" not in info  # the plan's own draft: no options beyond the plan
    assert info["self_speculative-tree"]["copy_candidates"] == 3 and info["self_speculative-tree"]["ngram"] == 1
    assert {r["method"] for r in lines[1:]} == {"autoregressive", "self_speculative", "self_speculative-tree"}
    outputs = {}
    for r in lines[1:]:
        outputs.setdefault(r["sample_id"], set()).add(r["output_sha256"])
    assert all(len(v) == 1 for v in outputs.values())  # fp32 greedy: the same text from all three


def test_a_variant_may_name_its_own_draft_file(tmp_path, capsys, tiny_plan):
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec

    other = tmp_path / "other.json"
    DraftSpec(SkipPlan(4, mlp=(1, 2), model="tiny-llama"), DraftOptions(ngram=2), k=3).save(other)
    run = tmp_path / "run"
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", *SHORT, "n_samples=2",
             "methods=[autoregressive,self_speculative,self_speculative-other,self_speculative-none]",
             f"+method_options.self_speculative-other.draft={other}",
             "+method_options.self_speculative-none.draft=empty", f"hydra.run.dir={run}")
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    fp = lines[0]["fingerprint"]
    assert fp["plans"]["self_speculative"] == {"num_layers": 4, "attn": [1], "mlp": [2]}
    assert fp["plans"]["self_speculative-other"] == {"num_layers": 4, "attn": [], "mlp": [1, 2]}
    assert fp["plans"]["self_speculative-none"] == {"num_layers": 4, "attn": [], "mlp": []}
    assert fp["decode"]["self_speculative"]["k"] == 2 and fp["decode"]["self_speculative-other"]["k"] == 3
    assert fp["method_info"]["self_speculative-other"]["ngram"] == 2
    outputs = {}
    for r in lines[1:]:
        outputs.setdefault(r["sample_id"], set()).add(r["output_sha256"])
    assert len(outputs) == 2 and all(len(v) == 1 for v in outputs.values())  # fp32 greedy: one text from all four
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none",
             "methods=[self_speculative-x]", f"+method_options.self_speculative-x.draft={tmp_path / 'no.json'}",
             f"hydra.run.dir={tmp_path / 'bad'}")
    assert p.returncode != 0 and "no draft file at" in p.stderr and "method_options.self_speculative-x.draft" in p.stderr


def test_split_calibration_decodes_the_calibration_rows(tmp_path, capsys, tiny_plan):
    ids = {}
    for split in ("eval", "calibration"):
        run = tmp_path / split
        p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", *SHORT, f"split={split}",
                 "n_samples=2", f"hydra.run.dir={run}")
        assert p.returncode == 0, p.stderr[-3000:]
        lines = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        assert lines[0]["split"] == split
        ids[split] = {r["sample_id"] for r in lines[1:]}
    assert ids["eval"] and ids["calibration"] and not ids["eval"] & ids["calibration"]
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "split=train",
             f"hydra.run.dir={tmp_path / 'bad'}")
    assert p.returncode != 0 and "split must be eval or calibration" in p.stderr


def test_a_run_with_many_long_overrides_gets_a_short_folder(tmp_path, capsys, monkeypatch, tiny_plan):
    """The run folder is named from the overrides; past what a file system allows it is their start and a hash,
    and the overrides stay whole in the folder's config record."""
    from selfspec.cli.config import short_folder_name

    long = [f"decoding.{key}=0.{'0' * 50}{i}" for i, key in enumerate(["threshold_step", "target_acceptance"])]
    long += [f"decoding.{key}={'1' * 40}" for key in ("fallback_min_rounds", "gate_probe")]
    long += ["decoding.top_p=0.99999999999999999999999999999999999999", "decoding.seed=1234567890123456789012345678"]
    assert len(",".join(long)) > 255  # one name longer than a file system allows
    monkeypatch.chdir(tmp_path)  # the run folder: results/runs/... under the working folder
    p = _run(capsys, "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1", "name=x",
             "decoding.max_new_tokens=4", *long)
    assert p.returncode == 0, p.stderr[-3000:]
    (folder,) = [f.parent for f in (tmp_path / "results/runs/x/tiny-llama/tiny").glob("*/samples.jsonl")]
    assert folder.name == short_folder_name(folder.name) and len(folder.name) == 96
    assert folder.name.startswith("decoding.fallback_min_rounds=111")  # readable: the overrides' start
    record = (folder / ".hydra" / "overrides.yaml").read_text()
    assert all(o in record for o in long)  # the whole overrides, in the folder's config record
    assert short_folder_name("decoding.k=2") == "decoding.k=2"


def test_an_override_naming_a_file_gives_one_folder_not_a_tree():
    from selfspec.cli.config import short_folder_name

    name = short_folder_name("+method_options.x={draft:results/plans/p.json},decoding.k=2")
    assert name == "+method_options.x={draft:results_plans_p.json},decoding.k=2"
    long = short_folder_name("+method_options.x={draft:results/plans/" + "p" * 120 + ".json}")
    assert "/" not in long and len(long) == 96
    assert "\\" not in short_folder_name("a=b\\c")


def _job_process(marker: str) -> int | None:
    """The pid of a job's own process whose command line holds ``marker`` (None while there is none)."""
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"selfspec.cli.evaluate" in cmd and marker.encode() in cmd:
            return int(proc.name)
    return None


@pytest.mark.cli
def test_a_killed_job_of_a_joblib_sweep_fails_alone(tmp_path, tiny_plan):
    """kill -9 of one job's process (as the out-of-memory killer would): the other jobs finish, the sweep exits 1
    and names it."""
    runs = tmp_path / "runs"
    sweep = subprocess.Popen(
        [sys.executable, str(ROOT / "experiments" / "evaluate.py"), "-m", "hydra/launcher=joblib",
         "hydra.launcher.n_jobs=2", "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "name=x",
         "n_samples=2", "decoding.max_new_tokens=8", "warmup_tokens=1", "decoding.seed=0,1,2",
         f"hydra.sweep.dir={runs}/x"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while (pid := _job_process("decoding.seed=1")) is None and time.time() < deadline and sweep.poll() is None:
        time.sleep(0.02)
    assert pid is not None, "the job's process never showed"
    os.kill(pid, signal.SIGKILL)
    _, err = sweep.communicate(timeout=600)
    assert sweep.returncode == 1 and "1 job(s) of this sweep failed" in err, err[-3000:]
    assert "decoding.seed=1" in err and "killed by SIGKILL" in err and "Traceback" not in err, err[-3000:]
    for seed in (0, 2):
        (job,) = (runs / "x/tiny-llama/tiny").glob(f"*decoding.seed={seed}*")
        assert (job / "summary.json").is_file()
