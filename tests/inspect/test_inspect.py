"""selfspec-inspect: each subcommand on a tiny model's study or on fixed rows; round-costs as its own process, the
others in this process."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from selfspec.draft.spec import DraftSpec
from selfspec.inspect import main as inspect_main
from selfspec.search.rounds import RoundCounts
from tests.helpers import ROOT, run_main


def _inspect(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "selfspec.inspect", name, *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def _run(capsys, name: str, *args: str) -> subprocess.CompletedProcess:
    """What `_inspect` starts, in this process."""
    return run_main(inspect_main, name, *args, capsys=capsys)


@pytest.mark.cli
def test_round_costs_sets_measured_parts_beside_the_cost_models(tmp_path, tiny_study):
    out = tmp_path / "costs.jsonl"
    p = _inspect("round-costs", str(tiny_study), "--name", "tiny-llama-default", "--top", "2", "--prompts", "2",
                "--tokens", "12", "--reps", "2", "--dtype", "float32", "--remeasure", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert 2 <= len(row["drafts"]) <= 4 and row["machine"] and row["kernels"]  # the top 2 and their skip-free twins
    for d in row["drafts"]:
        # the simulator replays the timed AR run's tokens: its rounds are the run's (fp32, tiny model), but for an
        # adaptive draft's drafted length, exact only while the draft agrees (tests/search/test_simulate.py): a study whose top
        # drafts include one failed here now and then (drafted 19 simulated, 20 run), the rest equal
        sim, run = dict(d["rounds"]["simulated"]), dict(d["rounds"]["measured"])
        if d["adaptive"]:
            sim.pop("drafted"), run.pop("drafted")
        assert sim == run, d["draft"]
        assert set(d["seconds"]["modelled"]) == {"draft", "verify", "plain"}
        assert all(v >= 0 for v in d["seconds"]["modelled"].values())
        assert (d["seconds"]["measured"]["verify"] > 0) == (d["rounds"]["measured"]["rounds"] > 0)
        assert (d["seconds"]["measured"]["plain"] > 0) == (d["rounds"]["measured"]["plain"] > 0)
        lo, hi = d["decode_speedup"]["range"]
        assert lo <= d["decode_speedup"]["measured"] <= hi and d["decode_speedup"]["predicted"] > 0
    assert "seconds measured / modelled" in p.stdout


def test_overhead_spread_measures_the_loop_overheads_again_and_again(tmp_path, capsys, tiny_study):
    out = tmp_path / "spread.jsonl"
    p = _run(capsys, "overhead-spread", str(tiny_study), "--name", "tiny-llama-default", "--times", "2", "--reps", "1",
             "--dtype", "float32", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(row["times"]) == 2 and row["reps"] == 1 and row["machine"] and row["formats"] >= 1
    per_format = [k for k in row["times"][0] if k.startswith("verify/")]  # one a weight format the study measured
    assert len(per_format) == row["formats"]
    for k in ("draft_step_ms", "verify_ms", *per_format):
        values = [t[k] for t in row["times"]]
        assert row["spread"][k]["min"] == min(values) and row["spread"][k]["max"] == max(values)
    assert "verify_ms: sd" in p.stdout and f"{per_format[0]}: sd" in p.stdout


def test_tree_bound_simulates_chain_trees_and_the_oracle(tmp_path, capsys, tiny_study):
    out, plan = tmp_path / "bound.jsonl", tiny_study.parent / "plans" / "tiny-llama-default.json"
    p = _run(capsys, "tree-bound", str(tiny_study), "--name", "tiny-llama-default", "--draft", str(plan), "--tokens", "12",
             "--groups", "--branch", "0.5", "--nodes", "6", "--k", "1", "7", "--adaptive", "0.5", "--fixed", "--stop",
             "--dtype", "float32", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["groups"] == ["all"] and record["machine"] and record["costs"]["t_full"] > 0
    k = json.loads(plan.read_text())["k"]
    depths = {f"{kind} k={d}" for d in (1, 7) if d != k for kind in ("chain", "oracle")}
    adaptive = {f"{rule} k={d}/0.5" for d in {1, 7, k} for rule in ("adaptive", "fixed")}
    stops = {f"stop k={d}" for d in {1, 7, k}}
    assert set(record["summary"]) == {"chain", "as found", "tree copies only/6", "tree 0.5/6", "oracle", *depths, *adaptive,
                                      *stops}
    rows = {r["variant"]: r for r in record["rows"]}
    assert {r["rounds"]["tokens"] for r in rows.values()} == {rows["chain"]["rounds"]["tokens"]}  # same continuations
    for label in [lab for lab in rows if lab.startswith("oracle")]:
        chain = rows[label.replace("oracle", "chain")]
        assert rows[label]["tokens_per_round"] >= chain["tokens_per_round"]
        assert rows[label]["decode_speedup"] >= chain["decode_speedup"] * 0.999
    assert record["summary"]["chain"]["tokens_gain"] == 1.0 and "oracle" in p.stdout
    for d in {1, 7, k}:  # a chain stopped where the target's continuation stops: the same tokens, no more drafted
        stop, chain = rows[f"stop k={d}"]["rounds"], rows["chain" if d == k else f"chain k={d}"]["rounds"]
        assert stop["tokens"] == chain["tokens"] and stop["accepted"] == chain["accepted"] and stop["drafted"] <= chain["drafted"]
    # a model draft of the tiny random model drafts every token far under 0.99: an exit there stops after one token,
    # so at any depth it drafts as a chain of k=1 does
    modeled = DraftSpec.load(plan)
    modeled = replace(modeled, k=3, options=replace(modeled.options, model_draft=True)).save(tmp_path / "model.json")
    one = _run(capsys, "tree-bound", str(tiny_study), "--name", "tiny-llama-default", "--draft", str(modeled),
               "--tokens", "12", "--groups", "--branch", "--nodes", "--k", "1", "7", "--adaptive", "0.99", "--dtype",
               "float32", "--out", str(out))
    assert one.returncode == 0, one.stderr[-2000:]
    drafted = {r["variant"]: r["rounds"]["model_rounds"] for r in json.loads(out.read_text().splitlines()[-1])["rows"]}
    assert drafted["chain k=1"] and set(drafted["chain k=1"]) == {"1"}
    assert drafted["adaptive k=7/0.99"] == drafted["adaptive k=3/0.99"] == drafted["chain k=1"] != drafted["chain k=7"]


def test_stop_rules_price_rules_on_the_draft_probabilities_against_the_oracle(tmp_path, capsys, tiny_study):
    draft = DraftSpec.load(tiny_study.parent / "plans" / "tiny-llama-default.json")
    plan = replace(draft, options=replace(draft.options, model_draft=True)).save(tmp_path / "model.json")
    out = tmp_path / "stops.jsonl"
    p = _run(capsys, "stop-rules", str(tiny_study), "--name", "tiny-llama-default", "--draft", str(plan), "--tokens",
             "12", "--groups", "--k", "4", "--thresholds", "0", "0.3", "1", "--splits", "2", "--dtype", "float32",
             "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    rules, n = record["summary"], record["rounds"]
    assert n > 0 and record["machine"] and "oracle" in p.stdout
    assert {"fixed 0", "fixed 0.3", "fixed 1", "prefix 0.3", "calibrated prefix 0.3", "fixed, fitted", "prefix, fitted",
            "calibrated prefix, fitted", "positions, fitted", "oracle"} <= set(rules)
    whole, one = rules["fixed 0"], rules["fixed 1"]  # no exit: every round drafts all it may; under 1: one token
    assert one["drafted"] == n and whole["drafted"] >= n and rules["prefix 0"] == whole
    # the oracle accepts what the chain without an exit accepts and drafts only that (a plain step where it is 0)
    oracle = rules["oracle"]
    assert oracle["accepted"] == oracle["drafted"] == whole["accepted"] and oracle["tokens"] == whole["tokens"]
    assert whole["tokens"] == whole["accepted"] + n and whole["plain_steps"] == 0
    for s in rules.values():  # every rule emits these rounds' tokens or fewer, at most 4 drafted a round
        assert s["accepted"] <= whole["accepted"] and s["drafted"] <= 4 * n and s["tokens"] <= whole["tokens"]
    # the calibration counts each round's tokens up to its first miss: its right ones are what the chain accepted
    right, seen = (sum(x[i] for x in record["calibration"]) for i in (1, 0))
    assert right == whole["accepted"] and right <= seen <= right + n
    # rounds accepted whole: under 1 each drafts one token, accepted whole where it is right; a later exit drafts more
    accepted_whole = record["accepted_whole"]
    assert set(accepted_whole) == {"0", "0.3", "1"} and accepted_whole["1"] == pytest.approx(one["accepted"] / n, abs=1e-4)
    assert 0 <= accepted_whole["0"] <= accepted_whole["0.3"] <= accepted_whole["1"] <= 1
    # the rules beyond the draft's probability, each over 2 halvings; the fixed exit's first is the fitted one above
    outside = record["outside"]
    assert set(outside["decode_speedup"]) == {"fixed", "by the margin", "rising with the position", "by copy agreement",
                                              "by the target's start", "by the round before", "learned, the draft's own",
                                              "learned, all"}
    assert set(outside["weights"]["all"]) == {"confidence", "margin", "position", "copy agrees", "copy differs", "start",
                                              "before", "intercept"}
    assert all(len(s) == 2 and min(s) > 0 for s in outside["decode_speedup"].values())
    assert outside["decode_speedup"]["fixed"][0] == pytest.approx(rules["fixed, fitted"]["decode_speedup"])
    assert set(outside["auc"]) == {"the draft's probability", "learned, the draft's own", "learned, all"}
    assert "held-out AUC" in p.stdout


def test_route_bounds_price_each_route_on_the_drafts_own_rounds(tmp_path, capsys, tiny_study):
    out, plan = tmp_path / "routes.jsonl", tmp_path / "int4.json"
    draft = json.loads((tiny_study.parent / "plans" / "tiny-llama-default.json").read_text())
    # int4 layers: the routes of fewer bits apply; copies of 2-grams: copying from inside a round does
    draft["options"] |= {"weights": "int4", "group_size": 32, "ngram": 2, "copy_tokens": 4}
    plan.write_text(json.dumps(draft))
    p = _run(capsys, "route-bounds", str(tiny_study), "--name", "tiny-llama-default", "--draft", str(plan), "--tokens",
             "12", "--groups", "--levels", "0.5", "--contexts", "40", "--top", "8", "--keep", "0.5", "--dtype", "float32",
             "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    routes, n = record["summary"], json.loads(plan.read_text())["num_layers"]
    assert {"as found", "exit oracle", "second level 0.5", "context 40", "context 40 no attention"} <= set(routes)
    inside = {g: RoundCounts.from_dict(c) for g, c in record["copy_inside_counts"].items()}
    found = {g: RoundCounts.from_dict(c) for g, c in record["counts"].items()}
    assert routes["copies inside a round, simulated"] > 0 and inside["all"].tokens == found["all"].tokens
    assert inside["all"].model_drafted <= found["all"].model_drafted
    assert 1 / n <= record["exit_fraction"]["all"] <= 1.0
    assert routes["exit oracle"] >= routes["as found"] * 0.999  # its layers cost at most what they cost
    assert routes["context 40 no attention"] >= routes["context 40"] * 0.999
    assert 0 <= record["contexts"]["40"]["attention_share_of_draft_step"] < 1 and "exit oracle" in p.stdout
    fewer = {"int4 lsq, simulated", "bits 3, simulated", "bits 2, simulated",  # simulated, each at its bits' price
             "MLP keep 0.5, simulated"}
    assert fewer <= set(routes) and set(record["fit_counts"]) == fewer and all(routes[r] > 0 for r in fewer)
    # the bounds: the same rounds with cheaper layers (equal where the found draft drafts nothing through them)
    assert routes["bits 2"] >= routes["bits 3"] * 0.999 and routes["bits 3"] >= routes["as found"] * 0.999
    assert routes["bits 2"] >= routes["MLP keep 0.5"] >= routes["as found"] * 0.999  # 2/3 of the MLPs' cost, no attention


def test_skip_scan_simulates_each_kept_sublayer_skipped_and_adds_the_best(tmp_path, capsys, tiny_study):
    out, plan = tmp_path / "scan.jsonl", tiny_study.parent / "plans" / "tiny-llama-default.json"
    p = _run(capsys, "skip-scan", str(tiny_study), "--name", "tiny-llama-default", "--draft", str(plan), "--tokens",
             "12", "--groups", "--steps", "2", "--dtype", "float32", "--out", str(out), "--write",
             str(tmp_path / "plus.json"))
    assert p.returncode == 0, p.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    draft = json.loads(plan.read_text())
    n, kept = draft["num_layers"], [(k, i) for k in ("attn", "mlp") for i in range(1, draft["num_layers"] - 1)
                                    if i not in draft[k]]
    first, second = record["steps"]
    assert sorted((c["kind"], c["layer"]) for c in first["candidates"]) == sorted(kept)
    speeds = [c["decode_speedup"] for c in first["candidates"]]
    assert speeds == sorted(speeds, reverse=True) and all(s > 0 for s in speeds)
    best = first["candidates"][0]
    assert best["layer"] in first[best["kind"]] and len(second["candidates"]) == len(kept) - 1
    assert len(second["attn"]) + len(second["mlp"]) == len(draft["attn"]) + len(draft["mlp"]) + 2 and n > 2
    assert "step 2:" in p.stdout and record["as_found"]["decode_speedup"] > 0
    written = json.loads((tmp_path / "plus.json").read_text())
    assert (written["attn"], written["mlp"], written["options"]) == (second["attn"], second["mlp"], draft["options"])
    # what it carries as measured is the scan's, not the measurements of the draft it came from
    assert written["measured"]["skip_scan_of"] == str(plan) and len(written["measured"]["added"]) == 2
    assert written["measured"]["predicted_decode_speedup"] == second["candidates"][0]["decode_speedup"]


def test_paired_ratio_prints_one_method_over_another_per_task_set(tmp_path, capsys):
    def row(sample, method, tokens, seconds, rounds=0, accepted=0):
        return {"type": "sample", "sample_id": sample, "method": method, "turns": 1, "new_tokens": tokens,
                "wall_time_s": seconds, "ttft_s": 0.1, "token_latencies_s": [seconds / tokens] * tokens,
                "rounds": rounds, "drafted": accepted + rounds, "accepted": accepted, "drafted_per_position": [],
                "accepted_per_position": [], "output_sha256": "x"}

    sets = {"gsm8k": [row("a", "tree", 20, 1.0, 4, 12), row("b", "tree", 30, 3.0, 6, 18),
                      row("a", "chain", 20, 2.0, 5, 10), row("b", "chain", 30, 3.0, 7, 16)],
            "mtbench": [row("a", "tree", 10, 1.0), row("a", "chain", 10, 1.0)]}  # the same sample id, another set
    for name, rows in sets.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _run(capsys, "paired-ratio", str(tmp_path / "m"), "tree", "chain")
    assert p.returncode == 0, p.stderr[-2000:]
    # 50 tokens in 4 s over 50 in 5 s; tokens a round 1 + 30/10 and 1 + 26/12
    assert "gsm8k" in p.stdout and "tree over chain (speed): 1.250x (95% " in p.stdout
    assert "tokens a round 4.00 / 3.17" in p.stdout
    # the first token (0.1 s a request) over each method's time on gsm8k: 0.2 of 4 s and 0.2 of 5 s
    assert "tokens a round 4.00 / 3.17; first token 5% / 4% of the time" in p.stdout
    # all rows: 60 tokens in 5 s over 60 in 6 s, mtbench's "a" its own sample (three pairs, not two)
    (pooled,) = [line for line in p.stdout.splitlines() if line.startswith("all sets")]
    assert "tree over chain (speed): 1.200x (95% " in pooled
    # decode speed: each request's first token and its 0.1 s left out: 48 tokens in 3.8 s over 48 in 4.8 s
    d = _run(capsys, "paired-ratio", str(tmp_path / "m"), "tree", "chain", "--decode")
    assert d.returncode == 0 and "gsm8k" in d.stdout and f"tree over chain (decode speed): {4.8 / 3.8:.3f}x" in d.stdout
    # what if the tree decoded twice as fast: on gsm8k its 3.8 s after the first tokens become 1.9 s, 50 tokens in
    # 2.1 s over 50 in 5 s; its decode speed doubles
    w = _run(capsys, "paired-ratio", str(tmp_path / "m"), "tree", "chain", "--decode-faster", "2")
    assert w.returncode == 0 and f"tree over chain (speed): {5 / 2.1:.3f}x" in w.stdout
    w = _run(capsys, "paired-ratio", str(tmp_path / "m"), "tree", "chain", "--decode-faster", "2", "--decode")
    assert f"tree over chain (decode speed): {2 * 4.8 / 3.8:.3f}x" in w.stdout
    assert _run(capsys, "paired-ratio", str(tmp_path / "m"), "tree", "chain", "--decode-faster", "0").returncode != 0
    assert _run(capsys, "paired-ratio", str(tmp_path / "m"), "tree", "ar").returncode != 0


def test_paired_ratio_gives_the_mean_of_the_four_task_sets_where_a_run_holds_them(tmp_path, capsys):
    def row(method, seconds):
        return {"type": "sample", "sample_id": "a", "method": method, "turns": 1, "new_tokens": 10,
                "wall_time_s": seconds, "ttft_s": 0.1, "token_latencies_s": [seconds / 10] * 10, "rounds": 0,
                "drafted": 0, "accepted": 0, "drafted_per_position": [], "accepted_per_position": [],
                "output_sha256": "x"}

    fast = {"humaneval": 1.0, "gsm8k": 2.0, "mtbench": 4.0, "summarization": 5.0, "unseen": 1.0}  # over 4 s: 4, 2, 1, 0.8
    for name, seconds in fast.items():
        (tmp_path / "m" / name).mkdir(parents=True)
        (tmp_path / "m" / name / "samples.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in (row("ours", seconds), row("ar", 4.0))))
    p = _run(capsys, "paired-ratio", str(tmp_path / "m"), "ours", "ar")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "mean of four     ours over ar: 1.950x (humaneval, gsm8k, mtbench, summarization)" in p.stdout  # unseen left out
    (tmp_path / "m" / "mtbench" / "samples.jsonl").unlink()
    (tmp_path / "m" / "mtbench").rmdir()
    assert "mean of four" not in _run(capsys, "paired-ratio", str(tmp_path / "m"), "ours", "ar").stdout


def test_paired_ratio_rounds_prints_what_a_round_cost_in_plain_steps(tmp_path, capsys):
    def row(sample, method, rounds, drafted, draft_time, verify_time, plain_steps=0, step_time=0.0, copy_rounds=0):
        counters = {"method": method, "requests": 1, "new_tokens": 20, "rounds": rounds, "drafted": drafted,
                    "copy_rounds": copy_rounds, "accepted": drafted, "plain_steps": plain_steps,
                    "draft_time": draft_time, "verify_time": verify_time, "step_time": step_time, "ttft": 0.1, "total_time": 2.0}
        return {"type": "sample", "sample_id": sample, "method": method, "turns": 1, "counters": counters,
                "output_sha256": "x"}

    rows = [row("a", "autoregressive", 0, 0, 0.0, 0.0, plain_steps=20, step_time=2.0),  # a step of 0.1 s
            row("a", "wide", 4, 28, 0.8, 0.6), row("a", "chain", 5, 25, 0.5, 0.6)]
    (tmp_path / "m" / "gsm8k").mkdir(parents=True)
    (tmp_path / "m" / "gsm8k" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _run(capsys, "paired-ratio", str(tmp_path / "m"), "wide", "chain", "--rounds")
    assert p.returncode == 0, p.stderr[-2000:]
    assert ("rounds of wide: 4 (0 copies), 7.00 drafted tokens, drafting 200.0 ms and a verify 150.0 ms a round "
            "(1.50 of autoregressive's steps)") in p.stdout
    assert ("rounds of chain: 5 (0 copies), 5.00 drafted tokens, drafting 100.0 ms and a verify 120.0 ms a round "
            "(1.20 ") in p.stdout
    assert "after a copy" not in p.stdout  # no copy rounds: the kinds cannot be told apart
    # two rows with model and copy rounds in other proportions: verifies of 0.12 s after a model draft, 0.2 s after
    # a copy (0.12 * 3 + 0.2 * 1 = 0.56 s; 0.12 * 1 + 0.2 * 2 = 0.52 s)
    rows += [row("a", "mixed", 4, 20, 0.4, 0.56, copy_rounds=1), row("b", "mixed", 3, 20, 0.2, 0.52, copy_rounds=2),
             row("b", "chain", 5, 25, 0.5, 0.6), row("b", "autoregressive", 0, 0, 0.0, 0.0, 20, 2.0)]
    (tmp_path / "m" / "gsm8k" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = _run(capsys, "paired-ratio", str(tmp_path / "m"), "mixed", "chain", "--rounds")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "; a verify after a model draft 120.0 ms, after a copy 200.0 ms (1.20 / 2.00 steps)" in p.stdout
    # 3 copy rounds of 3.8 s of decoding (4 s less 0.2 s to the first tokens): 0.08 s each over a model draft's
    # verify, 0.1 s over one step
    assert "; a copy's verify at a model draft's would save 6.3% of the decode time, at one step 7.9%" in p.stdout


def test_a_second_level_prices_each_levels_first_step_of_a_round():
    from collections import Counter
    from dataclasses import replace

    from selfspec import SkipPlan
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec
    from selfspec.inspect.route_bounds import second_level
    from selfspec.search.rounds import RoundCounts
    from tests.search.toy import COSTS

    costs = replace(COSTS, draft={**COSTS.draft, "int8": replace(COSTS.draft["int8"], first=1.5)},
                    overhead={"draft_step": 0.01})
    spec = DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(weights="int8"), k=3)
    counts = RoundCounts(tokens=20, plain_steps=1, model_rounds=Counter({3: 4, 1: 2}), copy_rounds=Counter({5: 1}),
                         drafted=14, accepted=12)
    # a first level as dear as the draft: the draft's rounds plus one checking step a round (a first step each)
    t = costs.time(counts, spec) + costs.draft_time(spec, 6, 6)
    assert second_level(costs, counts, spec, 1.0) == pytest.approx(20 * COSTS.t_full / t)
    assert second_level(costs, counts, spec, 0.25) > second_level(costs, counts, spec, 1.0)
