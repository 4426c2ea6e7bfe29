"""Configs compose; task sets load; the evaluation runner, its resume, sweeps, W&B and the tables."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir

from selfspec import DecodeConfig, DecodeStats, SelfSpecError, SkipPlan
from selfspec.assets.data import (
    asks_for_summary,
    load_task_set,
    sharegpt_first_turns,
)
from selfspec.cli.tables import main as tables_main
from selfspec.eval.records import decode_record
from selfspec.eval.tables import (
    load_runs,
    methods_overview,
    to_markdown,
    write_methods_overview,
    write_tables,
)
from tests.helpers import CONF, ROOT


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("experiment", _options("experiment"))
def test_every_experiment_composes(experiment):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    assert cfg.name == experiment
    assert cfg.hydra.mode is not None  # every experiment file is a sweep
    assert cfg.hydra.sweeper.params


@pytest.mark.parametrize("group", ["model", "dataset", "decoding", "logger"])
def test_every_group_option_composes_in_both_entry_points(group):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for option in _options(group):
            for entry in ("evaluate", "search"):
                if entry == "search" and group == "decoding":
                    continue
                cfg = compose(config_name=entry, overrides=[f"{group}={option}"])
                assert cfg[group] is not None


@pytest.mark.parametrize("name", ["default", "tiny"])
def test_inline_task_sets(name):
    ts = load_task_set(yaml.safe_load((CONF / "dataset" / f"{name}.yaml").read_text()))
    assert ts.calibration and ts.eval
    assert not {s.turns for s in ts.calibration} & {s.turns for s in ts.eval}


def test_json_task_set_and_split_checks(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"id": f"r{i}", "q": f"question {i}"}) + "\n" for i in range(10)))
    cfg = {"name": "mine", "source": "json", "path": str(f), "format": "plain", "options": {"text_field": "q"},
           "calibration": {"n": 3}, "eval": {"offset": 3, "n": 4, "stride": 2}}
    ts = load_task_set(cfg)
    assert [s.id for s in ts.calibration] == ["r0", "r1", "r2"]
    assert [s.turns[0] for s in ts.eval] == ["question 3", "question 5", "question 7", "question 9"]
    with pytest.raises(SelfSpecError, match="both the calibration and the eval"):
        load_task_set({**cfg, "eval": {"offset": 2, "n": 2}})
    with pytest.raises(SelfSpecError, match="only 10 samples"):
        load_task_set({**cfg, "eval": {"offset": 5, "n": 6}})
    with pytest.raises(SelfSpecError, match="no column"):
        load_task_set({**cfg, "options": {"text_field": "nope"}})


def test_sharegpt_parser_drops_the_truncated_tail(tmp_path):
    convs = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},
             {"id": "b", "conversations": [{"from": "gpt", "value": "first turn is not human"}]},
             {"id": "c", "conversations": [{"from": "human", "value": "x" * 50}]}]
    raw = json.dumps(convs)
    src = tmp_path / "sg.json"
    src.write_text(raw[: raw.rindex("{") + 20])  # cut inside the last conversation
    rows = [json.loads(l) for l in sharegpt_first_turns(src, tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows == [{"id": "a", "text": "hi"}]


def test_summarization_filter():
    body = "word " * 400
    assert asks_for_summary({"text": "Summarize this article:\n" + body}, {})
    assert asks_for_summary({"text": body + "\nPlease write a short summary."}, {})
    assert not asks_for_summary({"text": "Summarize: short"}, {})
    assert not asks_for_summary({"text": "Read this, don't summarize it yet.\n" + body}, {})
    assert not asks_for_summary({"text": body[:800] + " summary " + body[:800]}, {})  # only in the middle


@pytest.mark.integration
@pytest.mark.parametrize("name", ["humaneval", "gsm8k", "mtbench", "summarization"])
def test_packaged_task_sets(name):
    ts = load_task_set(yaml.safe_load((CONF / "dataset" / f"{name}.yaml").read_text()))
    assert len(ts.calibration) >= 8 and len(ts.eval) >= 10
    assert not {s.id for s in ts.calibration} & {s.id for s in ts.eval}
    if name == "mtbench":
        assert all(len(s.turns) == 2 for s in ts.eval)


# -- the runner end to end on a tiny model ---------------------------------------------

def _evaluate(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([sys.executable, str(ROOT / "experiments" / "evaluate.py"), *args], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "tiny.json"
    SkipPlan(4, attn=(1,), mlp=(2,), model="tiny-llama", provenance={"k": 2}).save(path)
    return path


def test_sweep_writes_jsonl_wandb_and_a_table(tmp_path, tiny_plan):
    runs = tmp_path / "runs"
    p = _evaluate("+experiment=smoke", f"plan={tiny_plan}", f"hydra.sweep.dir={runs}/smoke", cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    files = sorted(runs.glob("smoke/tiny-llama/tiny/*/samples.jsonl"))
    assert [f.parent.name for f in files] == ["decoding.k=2", "decoding.k=3"]  # one folder per job
    for f in files:
        lines = [json.loads(l) for l in f.read_text().splitlines()]
        head, rows = lines[0], lines[1:]
        assert head["type"] == "header" and head["provenance"]["git_commit"] is not None
        assert head["provenance"]["config"]["dataset"]["name"] == "tiny"
        assert len(rows) == 3 * 2  # 3 eval samples x 2 methods
        two_turns = [r for r in rows if r["turns"] == 2]
        assert len(two_turns) == 2 and all(len(r["output_text"]) == 2 for r in two_turns)
        spec = [r for r in rows if r["method"] == "self_speculative"]
        assert all(sum(r["counters"]["accepted_per_position"]) == r["counters"]["accepted"] for r in spec)
        assert list(f.parent.glob("wandb/offline-run-*"))  # an offline W&B run in the run folder
        assert json.loads((f.parent / "summary.json").read_text())["autoregressive"]["speedup"] == 1.0
    tables, figures = tmp_path / "tables", tmp_path / "figures"
    assert tables_main(["--runs", str(runs), "--tables", str(tables), "--figures", str(figures),
                        "--studies", str(tmp_path / "none")]) == 0
    md = (tables / "smoke.md").read_text()
    assert md.count("| tiny-llama | tiny |") == 4
    assert "- command: `python experiments/evaluate.py +experiment=smoke logger=none`" in md  # its provenance
    tex = (tables / "smoke.tex").read_text()
    assert tex.startswith("% # smoke\n") and "\\begin{tabular}" in tex
    assert (figures / "acceptance_by_position.png").stat().st_size > 0


def test_a_failed_job_does_not_stop_the_sweep_but_sets_its_exit_status(tmp_path, tiny_plan):
    runs = tmp_path / "runs"
    p = _evaluate("-m", "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "name=x",
                  "decoding.k=0,2", f"hydra.sweep.dir={runs}/x", cwd=ROOT)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "1 job(s) of this sweep failed" in p.stderr and "decoding.k=0: k (draft tokens per round)" in p.stderr
    assert "k (draft tokens per round) must be" in (runs / "x/tiny-llama/tiny/decoding.k=0/FAILED").read_text()
    assert (runs / "x/tiny-llama/tiny/decoding.k=2/samples.jsonl").is_file()
    assert not (runs / "x/tiny-llama/tiny/decoding.k=2/FAILED").exists()
    p = _evaluate("-m", "model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "name=x",
                  "decoding.k=2", f"hydra.sweep.dir={runs}/x", cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]  # an earlier sweep's failure is not this one's


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
        assert head["provenance"]["machine"]["torch_threads"] == max(1, (os.cpu_count() or 1) // 2) \
            if launcher == "joblib" else 1
        assert (job / ".hydra" / "overrides.yaml").is_file()


@pytest.mark.parametrize("where", ["hydra.run.dir", "logger.dir", "hydra.sweep.dir"])
def test_a_folder_that_cannot_be_written_is_one_line(tmp_path, tiny_plan, where):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    args = ["model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "n_samples=1", f"{where}={blocker}/sub"]
    if where == "logger.dir":
        args += ["logger=wandb", f"hydra.run.dir={tmp_path / 'run'}"]
    if where == "hydra.sweep.dir":
        args = ["-m", *args, "logger=none"]
    p = _evaluate(*args, cwd=ROOT)
    assert p.returncode == 2 and "cannot write the" in p.stderr and "Not a directory" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_a_misspelt_new_key_is_refused_not_ignored(tmp_path, tiny_plan):
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "+decodng.k=2",
                  f"hydra.run.dir={tmp_path / 'run'}", cwd=ROOT)
    assert p.returncode == 2 and "evaluate has no 'decodng' (did you mean decoding?)" in p.stderr
    assert not (tmp_path / "run" / "samples.jsonl").exists()


def test_the_paired_bootstrap_on_a_fixed_sample():
    from selfspec.eval.records import paired_bootstrap

    mine = [_row("a", "m", 10, 1.0), _row("b", "m", 10, 1.0)]
    base = [_row("a", "b", 10, 2.0), _row("b", "b", 10, 4.0)]
    # draws: {a,a} 2x (1/4), {a,b} 3x (1/2), {b,b} 4x (1/4): the 2.5% and 97.5% points are 2x and 4x
    assert paired_bootstrap(mine, base) == pytest.approx((2.0, 4.0))
    assert paired_bootstrap(mine, base) == paired_bootstrap(mine, base)  # seeded
    assert all(math.isnan(x) for x in paired_bootstrap(mine[:1], base))  # one pair: no interval


def test_tables_name_the_kernels_and_older_transformers_rows_ran_stock(tmp_path):
    head = {"type": "header", "model": "m", "dataset": "d", "baseline": "autoregressive",
            "fingerprint": {"methods": ["autoregressive", "hf_generate", "hf_prompt_lookup"],
                            "decode": {m: {"k": 3, "packed_weights": True} for m in ("autoregressive", "hf_generate",
                                                                                      "hf_prompt_lookup")},
                            "method_info": {"hf_prompt_lookup": {"kernels": "packed"}}}}
    rows = [_row(i, m, 10, 1.0) for i in ("a", "b") for m in head["fingerprint"]["methods"]]
    f = tmp_path / "runs" / "exp" / "m" / "d" / "samples.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text("".join(json.dumps(r) + "\n" for r in [head] + rows))
    got = {r["method"]: r["kernels"] for r in write_tables(load_runs(tmp_path / "runs"), tmp_path / "t")["exp"]}
    assert got == {"autoregressive": "packed", "hf_generate_stock": "stock", "hf_prompt_lookup": "packed"}
    for m in ("autoregressive", "hf_prompt_lookup"):  # a run on the decode attention says so
        head["fingerprint"]["decode"][m]["attention"] = "decode"
    f.write_text("".join(json.dumps(r) + "\n" for r in [head] + rows))
    got = {r["method"]: r["kernels"] for r in write_tables(load_runs(tmp_path / "runs"), tmp_path / "t")["exp"]}
    assert got == {"autoregressive": "packed + decode attn", "hf_generate_stock": "stock",
                   "hf_prompt_lookup": "packed + decode attn"}


def test_tables_mark_a_failed_partial_run(tmp_path, tiny_plan):
    runs = tmp_path / "runs"
    run = runs / "x" / "tiny-llama" / "tiny"
    assert _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1",
                     f"hydra.run.dir={run}", cwd=ROOT).returncode == 0
    (run / "FAILED").write_text("killed by a test\n")
    rows = write_tables(load_runs(runs), tmp_path / "tables")["x"]
    assert {r["variant"] for r in rows} == {"default (failed, partial)"}
    assert methods_overview({"x": rows}) == []


def test_runs_recorded_before_packed_weights_resume_with_them_off(monkeypatch):
    from selfspec.eval import records

    monkeypatch.setattr(records, "pack_format", lambda: "bf16")  # as on a CPU that packs bf16 (AVX2: tests/test_packed.py)
    assert "packed_weights" not in decode_record(DecodeConfig(packed_weights=False))
    rec = decode_record(DecodeConfig())
    assert rec["packed_weights"] is True and rec["k"] == DecodeConfig().k
    assert "packed_only" not in rec and decode_record(DecodeConfig(packed_only=True))["packed_only"] is True
    # the gate came later: runs recorded without it still resume; with it on, its settings are recorded
    assert "gate" not in rec and "gate_probe" not in rec
    assert decode_record(DecodeConfig(gate=True, gate_probe=4)) == {**rec, "gate": True, "gate_probe": 4}


def test_packed_only_refuses_the_transformers_methods(tmp_path, tiny_plan):
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1",
                  f"hydra.run.dir={tmp_path / 'run'}", "decoding.packed_only=true",
                  "methods=[autoregressive,hf_generate]", cwd=ROOT)
    assert p.returncode == 2 and "packed_only" in p.stderr and "hf_generate" in p.stderr


# -- the table builder on fixed rows -----------------------------------------------------

def _row(sample, method, tokens, time_s, drafted=0, accepted=0, rounds=0, sha="same", pos=None):
    return {"type": "sample", "sample_id": sample, "method": method, "turns": 1, "new_tokens": tokens,
            "wall_time_s": time_s, "tokens_per_s": tokens / time_s, "ttft_s": 0.1, "tpot_s": 0.05,
            "token_latencies_s": [time_s / tokens] * tokens, "rounds": rounds, "drafted": drafted,
            "accepted": accepted, "drafted_per_position": pos[0] if pos else [],
            "accepted_per_position": pos[1] if pos else [], "output_sha256": sha}


def _counters_row(row):
    """The same row in today's format: raw counters (rows before carried the derived fields)."""
    stats = DecodeStats(method=row["method"], new_tokens=row["new_tokens"], total_time=row["wall_time_s"],
                        ttft=row["ttft_s"], rounds=row["rounds"], drafted=row["drafted"], accepted=row["accepted"],
                        drafted_per_position=row["drafted_per_position"],
                        accepted_per_position=row["accepted_per_position"],
                        token_latencies=row["token_latencies_s"])
    return {"type": "sample", "sample_id": row["sample_id"], "method": row["method"], "turns": 1,
            "counters": stats.counters(), "output_sha256": row["output_sha256"]}


@pytest.mark.parametrize("row_format", ["counters", "legacy"])
def test_table_builder_numbers(tmp_path, row_format):
    head = {"type": "header", "model": "m", "dataset": "d", "baseline": "autoregressive",
            "fingerprint": {"methods": ["autoregressive", "self_speculative"],
                            "decode": {"autoregressive": {"k": 3}, "self_speculative": {"k": 3}},
                            "plans": {"self_speculative": {"num_layers": 4, "attn": [1], "mlp": [0, 2]}}},
            "extra_memory_bytes": {"self_speculative": 2 * 2**20}}
    rows = [_row("a", "autoregressive", 10, 2.0), _row("b", "autoregressive", 30, 4.0),
            _row("a", "self_speculative", 10, 1.0, 6, 3, 3, pos=([3, 2, 1], [2, 1, 0])),
            _row("b", "self_speculative", 30, 2.0, 12, 9, 4, sha="other", pos=([4, 4, 4], [4, 3, 2]))]
    if row_format == "counters":
        rows = [_counters_row(r) for r in rows]
    f = tmp_path / "runs" / "exp" / "m" / "d" / "samples.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text("".join(json.dumps(r) + "\n" for r in [head] + rows))
    by_exp = write_tables(load_runs(tmp_path / "runs"), tmp_path / "tables")
    ar, sp = by_exp["exp"]
    assert ar["speedup"] == 1.0 and ar["tokens_per_s"] == pytest.approx(40 / 6)
    assert sp["tokens_per_s"] == pytest.approx(40 / 3)
    assert sp["speedup"] == pytest.approx(2.0)
    assert sp["acceptance_rate"] == pytest.approx(12 / 18)
    assert sp["mean_accepted_length"] == pytest.approx(1 + 12 / 7)
    assert sp["greedy_match"] == 0.5
    assert (sp["attn_skipped"], sp["mlp_skipped"], sp["k"]) == (1, 2, 3)
    assert sp["acceptance_by_position"] == pytest.approx([6 / 7, 4 / 6, 2 / 5])
    assert sp["extra_memory_mb"] == 2.0
    csv_lines = (tmp_path / "tables" / "exp.csv").read_text().splitlines()
    assert csv_lines[0].startswith("model,dataset,variant,method") and len(csv_lines) == 3
    assert "| m | d | default | self_speculative | stock | 2 | 1 | 2 | 3 | 0.67 | 2.71 | 13.33 | 2.00x ±0.00 | 0.50 |" in \
        (tmp_path / "tables" / "exp.md").read_text()
    assert not math.isnan(sp["ttft_s"])
    assert (tmp_path / "tables" / "exp.md").read_text().startswith("# exp\n")  # the provenance list first
    ar_row, sp_row = methods_overview(by_exp)
    assert (sp_row["run"], sp_row["method"], sp_row["sets"]) == ("exp", "self_speculative", {"d": pytest.approx(2.0)})
    assert sp_row["mean"] == pytest.approx(2.0) and ar_row["mean"] == 1.0
    write_methods_overview([ar_row, sp_row], tmp_path / "tables" / "methods")
    methods_md = (tmp_path / "tables" / "methods.md").read_text()
    assert "| exp | m | self_speculative | 2.00x | 2.00x |" in methods_md
    assert (tmp_path / "tables" / "methods.csv").read_text().splitlines()[0] == "run,model,method,d,mean"


def test_tables_show_each_pass_and_the_drift_of_a_run_of_several_passes(tmp_path):
    head = {"type": "header", "model": "m", "dataset": "d", "baseline": "autoregressive",
            "fingerprint": {"methods": ["autoregressive", "self_speculative"],
                            "decode": {"autoregressive": {"k": 3}, "self_speculative": {"k": 3}}}}
    # AR slows from pass 0 to pass 1 (drift -20%); the draft's speedup is 2x in pass 0 and 2.5x in pass 1
    rows = [dict(_row(s, "autoregressive", 10, 1.0), rep=0) for s in ("a", "b")]
    rows += [dict(_row(s, "autoregressive", 8, 1.0), rep=1) for s in ("a", "b")]
    rows += [dict(_row(s, "self_speculative", 20, 1.0), rep=r) for s in ("a", "b") for r in (0, 1)]
    f = tmp_path / "runs" / "exp" / "m" / "d" / "samples.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text("".join(json.dumps(r) + "\n" for r in [head] + rows))
    ar, sp = write_tables(load_runs(tmp_path / "runs"), tmp_path / "tables")["exp"]
    assert (ar["samples"], ar["reps"]) == (2, 2) and ar["drift"] == pytest.approx(0.8)
    assert sp["pass_speedups"] == pytest.approx([2.0, 2.5]) and sp["drift"] == pytest.approx(1.0)
    assert sp["speedup"] == pytest.approx(40 / 18)
    md = (tmp_path / "tables" / "exp.md").read_text()
    assert "| passes | speedup per pass | drift |" in md and "| 2 | 2.00-2.50x | +0% |" in md and "| -20% |" in md
    # a table of single-pass runs keeps its old columns
    assert "passes" not in to_markdown([dict(ar, reps=1, pass_speedups=None, drift=float("nan"))])


def test_tables_compare_our_methods_with_the_fastest_peer_paired_by_prompt(tmp_path):
    methods = ["autoregressive", "self_speculative", "hf_prompt_lookup-n5", "hf_assisted-n8"]
    head = {"type": "header", "model": "m", "dataset": "d", "baseline": "autoregressive",
            "fingerprint": {"methods": methods, "decode": {m: {"k": 3} for m in methods},
                            "method_info": {m: {"kernels": "packed"} for m in methods[2:]}}}
    # per prompt a, b: AR 10 tokens in 2 s and 4 s; ours in 1 s and 1 s; prompt lookup (the faster peer)
    # in 0.5 s and 2 s; assisted in 1.5 s and 3 s
    times = {"autoregressive": (2.0, 4.0), "self_speculative": (1.0, 1.0), "hf_prompt_lookup-n5": (0.5, 2.0),
             "hf_assisted-n8": (1.5, 3.0)}
    rows = [_row(s, m, 10, t[i]) for m, t in times.items() for i, s in enumerate("ab")]
    f = tmp_path / "runs" / "exp" / "m" / "d" / "samples.jsonl"
    f.parent.mkdir(parents=True)
    f.write_text("".join(json.dumps(r) + "\n" for r in [head] + rows))
    got = {r["method"]: r for r in write_tables(load_runs(tmp_path / "runs"), tmp_path / "tables")["exp"]}
    ours = got["self_speculative"]
    assert ours["peer"] == "hf_prompt_lookup-n5" and ours["over_peer"] == pytest.approx(2.5 / 2.0)
    # draws: {a,a} 0.5x, {a,b} 1.25x, {b,b} 2x: the 2.5% and 97.5% points
    assert ours["over_peer_ci95"] == pytest.approx([0.5, 2.0])
    assert all("over_peer" not in got[m] for m in ("autoregressive", "hf_prompt_lookup-n5", "hf_assisted-n8"))
    md = (tmp_path / "tables" / "exp.md").read_text()
    assert "| over fastest peer (95%) |" in md and "| 1.25x (0.50-2.00) over hf_prompt_lookup-n5 |" in md
    lines = (tmp_path / "tables" / "exp.csv").read_text().splitlines()
    assert lines[0].endswith(",peer,over_peer_lo95,over_peer_hi95") and ",hf_prompt_lookup-n5,0.5," in lines[2]
    # a run with no peer keeps its old columns
    assert "peer" not in to_markdown([dict(ours, over_peer=None)])


def test_mix_takes_calibration_rows_of_each_part_and_never_their_eval_rows():
    part = lambda name, n: {"name": name, "source": "inline", "calibration": [f"{name} c{i}" for i in range(n)],  # noqa: E731
                            "eval": [f"{name} e{i}" for i in range(3)]}
    cfg = {"name": "m", "source": "mix", "parts": [part("a", 4), part("b", 5)], "calibration_per_part": 2,
           "heldout_per_part": 2}
    ts = load_task_set(cfg)
    assert [s.turns[0] for s in ts.calibration] == ["a c0", "a c1", "b c0", "b c1"]
    assert [s.turns[0] for s in ts.eval] == ["a c2", "a c3", "b c2", "b c3"]
    with pytest.raises(SelfSpecError, match="part 'a' has 4 calibration rows"):
        load_task_set({**cfg, "heldout_per_part": 3})


def test_the_tasks_mix_composes_from_the_four_sets():
    from selfspec.cli.config import dataset_config

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="search", overrides=["dataset=tasks"])
    d = dataset_config(cfg)
    assert [p["name"] for p in d["parts"]] == ["humaneval", "gsm8k", "mtbench", "summarization"]


def test_the_search_re_times_and_checks_held_out_on_prompts_of_every_kind():
    from selfspec.cli.config import dataset_config
    from selfspec.search.variants import spread

    assert spread(12, 4) == [0, 3, 6, 9] and spread(8, 2) == [0, 4] and spread(3, 5) == [0, 1, 2]
    assert spread(5, 0) == []
    # the tasks mix lists each set's rows in a block: 3 calibration and 2 held-out rows per set
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="search", overrides=["dataset=tasks"])
    per_cal, per_held, parts = cfg.dataset.calibration_per_part, cfg.dataset.heldout_per_part, len(cfg.dataset.parts)
    assert [i // per_cal for i in spread(per_cal * parts, cfg.search.retime.prompts)] == list(range(parts))
    assert [i // per_held for i in spread(per_held * parts, cfg.search.heldout.prompts)] == list(range(parts))
    # the default set: its re-timed and held-out prompts are one code, one math, one chat, one summarization prompt
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="search")
    d = dataset_config(cfg)
    kinds = {"code": ("Python",), "math": ("step by step", "Show your work"), "summarization": ("Summarize",)}

    def kind(text: str) -> str:
        return next((k for k, words in kinds.items() if any(w in text for w in words)), "chat")

    for texts, n in ((d["calibration"], cfg.search.retime.prompts), (d["heldout"], cfg.search.heldout.prompts)):
        picked = [kind(texts[i]) for i in spread(len(texts), n)]
        assert sorted(picked) == ["chat", "code", "math", "summarization"], picked


# -- task quality scorers on fixed inputs ---------------------------------------------------

HUMANEVAL_REF = {"prompt": 'def add(a, b):\n    """Return a + b."""\n', "entry_point": "add",
                 "test": "def check(f):\n    assert f(1, 2) == 3\n    assert f(-1, 1) == 0\n"}


def test_humaneval_scorer_runs_the_tests_in_a_subprocess():
    from selfspec.eval.quality import humaneval_passes

    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    body_only = "    return a + b\n"
    hangs = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert humaneval_passes(good, HUMANEVAL_REF) and humaneval_passes(body_only, HUMANEVAL_REF)
    assert not humaneval_passes(wrong, HUMANEVAL_REF)
    assert not humaneval_passes(hangs, HUMANEVAL_REF, timeout_s=2.0)
    assert not humaneval_passes("```python\ndef add(a, b):\n    return (a +\n```", HUMANEVAL_REF)  # cut off


def test_gsm8k_scorer_and_rouge_l():
    from selfspec.eval.quality import gsm8k_correct, quality, rouge_l

    ref = {"answer": "She sells 16 - 3 - 4 = 9 eggs.\n9 * 2 = 18\n#### 18"}
    assert gsm8k_correct("So she makes 9 * 2 = $18 every day.", ref)
    assert not gsm8k_correct("So she makes $20 a day.", ref) and not gsm8k_correct("no number", ref)
    assert gsm8k_correct("The total is 1,200.", {"answer": "#### 1200"})
    assert rouge_l("a b c d", "a b c d") == 1.0 and rouge_l("a b", "c d") == 0.0
    assert rouge_l("a b c d", "a c d e") == pytest.approx(0.75)  # LCS a c d: P = R = 3/4
    rows = [{"sample_id": "x", "output_text": ["= 18"], "reference": ref},
            {"sample_id": "y", "output_text": ["= 17"], "reference": ref}]
    base = [{"sample_id": "x", "output_text": ["= 18"]}, {"sample_id": "y", "output_text": ["= 18"]}]
    assert quality(rows, base) == {"accuracy": 0.5, "rouge_l_vs_baseline": 0.75}  # (1 + 1/2) / 2


def test_task_set_rows_carry_their_references():
    from selfspec.assets.data import FORMATS

    he = FORMATS["humaneval"]({"task_id": "HumanEval/0", **HUMANEVAL_REF}, 0, {})
    assert he.reference["entry_point"] == "add" and HUMANEVAL_REF["prompt"] in he.turns[0]
    gsm = FORMATS["gsm8k"]({"question": "How many?", "answer": "#### 3"}, 7, {})
    assert gsm.reference == {"answer": "#### 3"} and gsm.id == "gsm8k/7"


def test_method_variants_run_side_by_side_with_their_own_options(tmp_path, tiny_plan):
    run = tmp_path / "run"
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none",
                  "methods=[autoregressive,self_speculative,self_speculative-tree]",
                  "+method_options.self_speculative-tree.ngram=1",
                  "+method_options.self_speculative-tree.copy_candidates=3", f"hydra.run.dir={run}", cwd=ROOT)
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


def test_a_variant_may_name_its_own_draft_file(tmp_path, tiny_plan):
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec

    other = tmp_path / "other.json"
    DraftSpec(SkipPlan(4, mlp=(1, 2), model="tiny-llama"), DraftOptions(ngram=2), k=3).save(other)
    run = tmp_path / "run"
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=2",
                  "methods=[autoregressive,self_speculative,self_speculative-other,self_speculative-none]",
                  f"+method_options.self_speculative-other.draft={other}",
                  "+method_options.self_speculative-none.draft=empty", f"hydra.run.dir={run}", cwd=ROOT)
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
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none",
                  "methods=[self_speculative-x]", f"+method_options.self_speculative-x.draft={tmp_path / 'no.json'}",
                  f"hydra.run.dir={tmp_path / 'bad'}", cwd=ROOT)
    assert p.returncode != 0 and "no draft file at" in p.stderr and "method_options.self_speculative-x.draft" in p.stderr


def test_split_calibration_decodes_the_calibration_rows(tmp_path, tiny_plan):
    ids = {}
    for split in ("eval", "calibration"):
        run = tmp_path / split
        p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", f"split={split}",
                      "n_samples=2", f"hydra.run.dir={run}", cwd=ROOT)
        assert p.returncode == 0, p.stderr[-3000:]
        lines = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
        assert lines[0]["split"] == split
        ids[split] = {r["sample_id"] for r in lines[1:]}
    assert ids["eval"] and ids["calibration"] and not ids["eval"] & ids["calibration"]
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "split=train",
                  f"hydra.run.dir={tmp_path / 'bad'}", cwd=ROOT)
    assert p.returncode != 0 and "split must be eval or calibration" in p.stderr


def test_search_importance_names_the_parameter_that_drives_the_score(tmp_path):
    import numpy as np
    import optuna

    from selfspec.eval.figures import dimension_of, param_importances, write_figures

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    noise = np.random.default_rng(0).normal(size=80)  # mlp_5 and threshold do not move the score

    def score(t):
        t.suggest_int("mlp_5", 0, 1), t.suggest_float("threshold", 0.0, 1.0)
        return 3.0 * t.suggest_int("attn_3", 0, 1) + noise[t.number]

    study.optimize(score, n_trials=80)
    imp = param_importances(study.trials)
    assert max(imp, key=imp.get) == "attn_3" and imp["attn_3"] > 0.5
    assert (dimension_of("attn_3"), dimension_of("mlp_12"), dimension_of("k")) == ("attention skips", "MLP skips", "k")
    studies = tmp_path / "optuna"
    studies.mkdir()
    optuna.copy_study(from_study_name=study.study_name, from_storage=study._storage,
                      to_storage=f"sqlite:///{studies / 's.db'}", to_study_name="s")
    written = write_figures({}, studies, tmp_path / "figures")
    assert tmp_path / "figures" / "search_importance.png" in written
    rows = (tmp_path / "figures" / "search_importance.csv").read_text().splitlines()
    assert rows[0] == "study,parameter,dimension,importance" and rows[1].startswith("s,attn_3,attention skips,")


def test_search_importance_csv_orders_ties_by_name(tmp_path):
    from selfspec.eval.figures import _importance_csv

    path = _importance_csv({"s": {"mlp_4": 0.03081, "attn_1": 0.030799, "k": 0.5, "attn_0": 0.001}}, tmp_path / "i.csv")
    assert [r.split(",")[1] for r in path.read_text().splitlines()[1:]] == ["k", "attn_1", "mlp_4", "attn_0"]


def test_a_run_with_many_long_overrides_gets_a_short_folder(tmp_path, tiny_plan):
    """The run folder is named from the overrides; past what a file system allows it is their start and a hash,
    and the overrides stay whole in the folder's config record."""
    from selfspec.cli.config import short_folder_name

    long = [f"decoding.{key}=0.{'0' * 50}{i}" for i, key in enumerate(["threshold_step", "target_acceptance"])]
    long += [f"decoding.{key}={'1' * 40}" for key in ("fallback_min_rounds", "gate_probe")]
    long += ["decoding.top_p=0.99999999999999999999999999999999999999", "decoding.seed=1234567890123456789012345678"]
    assert len(",".join(long)) > 255  # one name longer than a file system allows
    p = _evaluate("model=tiny-llama", "dataset=tiny", f"plan={tiny_plan}", "logger=none", "n_samples=1", "name=x",
                  "decoding.max_new_tokens=4", *long, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    (folder,) = [f.parent for f in (tmp_path / "results/runs/x/tiny-llama/tiny").glob("*/samples.jsonl")]
    assert folder.name == short_folder_name(folder.name) and len(folder.name) == 96
    assert folder.name.startswith("decoding.fallback_min_rounds=111")  # readable: the overrides' start
    record = (folder / ".hydra" / "overrides.yaml").read_text()
    assert all(o in record for o in long)  # the whole overrides, in the folder's config record
    assert short_folder_name("decoding.k=2") == "decoding.k=2"
