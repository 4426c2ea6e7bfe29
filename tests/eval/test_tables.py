"""The tables from fixed rows: the numbers, kernels, passes and drift, the fastest peer paired by prompt."""

import json
import math

import pytest

from selfspec import DecodeStats
from selfspec.eval.tables import load_runs, methods_overview, to_markdown, write_methods_overview, write_tables


def test_the_paired_bootstrap_on_a_fixed_sample():
    from selfspec.eval.records import paired_bootstrap

    mine = [_row("a", "m", 10, 1.0), _row("b", "m", 10, 1.0)]
    base = [_row("a", "b", 10, 2.0), _row("b", "b", 10, 4.0)]
    # draws: {a,a} 2x (1/4), {a,b} 3x (1/2), {b,b} 4x (1/4): the 2.5% and 97.5% points are 2x and 4x
    assert paired_bootstrap(mine, base) == pytest.approx((2.0, 4.0))
    assert paired_bootstrap(mine, base) == paired_bootstrap(mine, base)  # seeded
    assert all(math.isnan(x) for x in paired_bootstrap(mine[:1], base))  # one pair: no interval



def test_the_paired_speedup_is_total_over_total_on_the_samples_both_decoded():
    from selfspec.eval.records import paired_bootstrap, paired_speedup

    mine = [_row("a", "m", 10, 1.0), _row("b", "m", 10, 1.0), _row("c", "m", 10, 9.0)]  # c: no base row, left out
    base = [_row("a", "b", 10, 2.0), _row("b", "b", 10, 4.0)]
    ratio, lo, hi = paired_speedup(mine, base)
    assert ratio == pytest.approx((20 / 2) / (20 / 6)) and (lo, hi) == paired_bootstrap(mine, base)
    assert paired_speedup(mine, [_row("z", "b", 10, 1.0)])[0] is None  # no sample in common

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
            "fingerprint": {"methods": ["autoregressive", "self_speculative"], "max_new_tokens": 16,
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
    assert "- new tokens: at most 16 a turn; task quality scores the answers as cut there" in \
        (tmp_path / "tables" / "exp.md").read_text()
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
