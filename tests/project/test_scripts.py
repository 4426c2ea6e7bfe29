"""The measurement scripts run from the repository root on a tiny model and append one JSON line."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.cli


def _script(name: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)


def test_measure_draft_appends_one_row_per_setting(tmp_path):
    out = tmp_path / "draft.jsonl"
    p = _script("measure_draft.py", "--model", "tiny-llama", "--datasets", "tiny", "--prompts", "2",
                "--max-new-tokens", "12", "--setting", "plan=empty ngram=2 k=3", "--setting", "plan=empty k=2",
                "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["setting"] for r in rows] == ["plan=empty ngram=2 k=3", "plan=empty k=2"]
    assert all(r["prompts"] == 2 and r["speedup"] > 0 and r["identical"].endswith("/2") for r in rows)


def test_measure_draft_keeps_the_draft_files_options(tmp_path):
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec
    from selfspec.model.plan import SkipPlan

    draft = DraftSpec(SkipPlan(4, mlp=(2,)), DraftOptions(weights="int4", group_size=32, head_weights="int4",
                                                          head_rescore=2, ngram=2, copy_per_match=2), k=3, k_max=5)
    path = draft.save(tmp_path / "draft.json")
    out = tmp_path / "draft.jsonl"
    p = _script("measure_draft.py", "--model", "tiny-llama", "--datasets", "tiny", "--prompts", "1",
                "--max-new-tokens", "8", "--setting", f"plan={path} head_ids=frequent head=64 k=2 adaptive=1",
                "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert {k: row["options"][k] for k in ("weights", "group_size", "head_weights", "head_rescore", "ngram",
                                           "copy_per_match", "head_ids", "head_tokens")} == {
        "weights": "int4", "group_size": 32, "head_weights": "int4", "head_rescore": 2, "ngram": 2,
        "copy_per_match": 2, "head_ids": "frequent", "head_tokens": 64}
    assert row["decoding"]["k"] == 2 and row["decoding"]["k_max"] == 5 and row["decoding"]["adaptive"] is True
    bad = _script("measure_draft.py", "--model", "tiny-llama", "--datasets", "tiny", "--prompts", "1",
                  "--setting", "plan=empty heads=4", "--out", str(tmp_path / "bad.jsonl"))
    assert bad.returncode != 0 and "unknown key 'heads'" in bad.stderr


def test_hugepages_times_both_instances_in_turns(tmp_path):
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec
    from selfspec.model.plan import SkipPlan

    draft = DraftSpec(SkipPlan(4, attn=(1,)), DraftOptions(ngram=2), k=3).save(tmp_path / "draft.json")
    out = tmp_path / "huge.jsonl"
    p = _script("hugepages.py", "--model", "tiny-llama", "--dataset", "tiny", "--draft", str(draft), "--reps", "2",
                "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = {"plain", "first draft step", "later draft step", "verify"}
    assert set(row["median_ms"]) == {"4 KiB pages", "huge pages"} and row["k"] == 3
    assert all(set(v) == kinds and min(v.values()) > 0 for v in row["median_ms"].values())
    for kind, (lo, hi) in row["huge_over_4k_interval"].items():
        assert lo <= hi and row["huge_over_4k"][kind] > 0
    assert all(r > 1 for r in row["round_in_plain_steps"].values())  # three draft steps and a verify: over one step


def test_hugepages_compares_two_packings_of_the_full_model(tmp_path):
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec
    from selfspec.kernels import amx, fp16
    from selfspec.kernels.packed import packing_supported
    from selfspec.model.plan import SkipPlan

    if not (packing_supported() and fp16.available()):
        pytest.skip("needs oneDNN's bf16 packing and our fp16 kernel")
    kernels = ["fp16", "amx"] if amx.available() else ["bf16", "fp16"]
    draft = DraftSpec(SkipPlan(4, mlp=(2,)), DraftOptions(), k=2).save(tmp_path / "draft.json")
    out = tmp_path / "pair.jsonl"
    p = _script("hugepages.py", "--model", "tiny-llama", "--dataset", "tiny", "--draft", str(draft), "--reps", "2",
                "--kernels", *kernels, "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert set(row["median_ms"]) == set(kernels) and "huge_page_bytes" not in row
    assert len(set(row["kernels"].values())) == 2  # each instance says what it computed on
    for kind, (lo, hi) in row["over_first_interval"].items():
        assert lo <= hi and row["over_first"][kind] > 0
    p = _script("hugepages.py", "--model", "tiny-llama", "--draft", str(draft), "--kernels", "fp16", "fp16")
    assert p.returncode != 0 and "two different packings" in p.stderr


def test_ar_vs_hf_appends_one_row(tmp_path):
    out = tmp_path / "ar.jsonl"
    p = _script("ar_vs_hf.py", "--model", "tiny-llama", "--datasets", "tiny", "--reps", "2",
                "--max-new-tokens", "8", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["autoregressive"]["tok_s"] > 0 and row["hf_generate"]["tok_s"] > 0


def test_sampler_bench_appends_one_row(tmp_path):
    out = tmp_path / "sampler.jsonl"
    p = _script("sampler_bench.py", "--model", "tiny-llama", "--dataset", "tiny", "--reps", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["same_sizes"] is True and row["max_kept_mass_gap"] < 1e-5 and row["rows_same_support"] >= row["rows"] - 4
    assert row["ms_per_row"]["ours"] > 0 and row["ratio"] > 0
    assert row["ratio_min_max"][0] <= row["ratio"] <= row["ratio_min_max"][1]
    greedy = row["greedy"]
    assert greedy["same_ids"] is True and set(greedy["ms_per_row"]) == {"ours 1 row", "ours 6 rows", "argmax 1 row",
                                                                        "argmax 6 rows"}
    assert min(greedy["ms_per_row"].values()) > 0


def test_sim_batch_bench_appends_one_row(tmp_path, tiny_study):
    out = tmp_path / "sim.jsonl"
    p = _script("sim_batch_bench.py", str(tiny_study), "tiny-llama-default", "--trials", "3",
                "--batches", "1", "2", "--dtype", "float32", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["drafts"] == 3 and set(row["batches"]) == {"1", "2"}
    # the tiny model runs in fp32: side by side, every draft's counts equal those of one prompt at a time
    assert row["batches"]["2"]["drafts_whose_counts_differ_from_first"] == 0
    assert row["batches"]["2"]["mean_s_per_draft"] > 0 and row["machine"]


def test_device_check_appends_one_row_on_the_cpu(tmp_path):
    out = tmp_path / "device.jsonl"
    p = _script("device_check.py", "--device", "cpu", "--quick", "--max-new-tokens", "16", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    (arch,) = row["archs"].values()
    for what in ("fp32", "bf16"):  # the checks the tests already hold on the CPU: every output equal to AR
        assert arch[what]["same"] == arch[what]["runs"] > 0, arch[what]["misses"]
    assert arch["sampling_seeded"] is True and arch["clock"]["clock_s"] > 0 and arch["clock"]["tokens"] == 16


def test_quant_alignment_prices_every_int4_fit_of_the_draft_the_head_s_share_and_the_bounds(tmp_path, tiny_study):
    out, found = tmp_path / "fits.jsonl", tiny_study.parent / "plans" / "tiny-llama-default.json"
    plan = json.loads(found.read_text())
    plan["options"] |= {"head_weights": "int4", "head_rescore": 0, "model_draft": True}  # a quantized head, priced too
    (tmp_path / "draft.json").write_text(json.dumps(plan))
    p = _script("quant_alignment.py", str(tiny_study), "--name", "tiny-llama-default", "--draft",
                str(tmp_path / "draft.json"), "--tokens", "12", "--groups", "--sizes", "32", "--layers", "0",
                "--dtype", "float32", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (record,) = [json.loads(line) for line in out.read_text().splitlines()]
    drafts = record["drafts"]
    assert set(drafts) == {"as found", "kept weights bf16", "int4 g32 minmax", "int4 g32 lsq", "int4 g32 grid",
                           "exact weights at the draft's price", "as found, head top 8 rescored",
                           "int4 g32 grid, head top 8 rescored", "head bf16",
                           "the model itself drafting (layers and head bf16)"}
    assert all(d["mean"] > 0 and d["tokens_per_round"] >= 1 for d in drafts.values())
    assert "top 8 rescored" in drafts["int4 g32 grid, head top 8 rescored"]["spec"]
    assert "int4" not in drafts["the model itself drafting (layers and head bf16)"]["spec"]
    errors = {fit: drafts[f"int4 g32 {fit}"]["relative_output_error"] for fit in ("minmax", "lsq", "grid")}
    assert 0 < errors["grid"] <= errors["lsq"] * 1.001 and errors["lsq"] <= errors["minmax"] * 1.001
    assert drafts["int4 g32 grid, head top 8 rescored"]["relative_output_error"] == errors["grid"]
    assert drafts["exact weights at the draft's price"]["tokens_per_round"] == drafts["kept weights bf16"]["tokens_per_round"]


def test_linear_bench_times_the_packed_products_from_memory_and_from_cache(tmp_path):
    out = tmp_path / "linear.jsonl"
    p = _script("linear_bench.py", "--layers", "1", "--rows", "1", "6", "--reps", "1", "--resident-mb", "5",
                "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["machine"]["cpu"] and row["resident_mb"] == 4.5 and set(row["rows"]) == {"1", "6"}
    for r in row["rows"].values():
        assert r["packed_gb_s"] > 0 and r["packed_resident_gb_s"] > 0
        # the ratio of the two times (rounded to 0.01), which the rates (each rounded to 0.1 GB/s) give back to within
        # their rounding: between the extremes of their rounding intervals (on a busy machine a rate of 0.9 GB/s
        # leaves the ratio +-6%, which no fixed tolerance on it covers)
        cache, memory = r["packed_resident_gb_s"], r["packed_gb_s"]
        assert (cache - 0.05) / (memory + 0.05) - 0.005 <= r["compute_over_memory"] <= (cache + 0.05) / (memory - 0.05) + 0.005


def test_roofline_sets_each_product_against_the_machine_s_limits(tmp_path):
    out = tmp_path / "roofline.jsonl"
    p = _script("roofline.py", "--layers", "1", "--rows", "1", "6", "--reps", "1", "--gemm", "128", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    limits = row["limits"]
    assert limits["memory_gb_s"] > 0 and limits["gemm_gflop_s"] > 0
    assert limits["fma_peak_gflop_s"] is None or limits["fma_peak_gflop_s"] > 0
    assert {"packed x1", "packed x6"} <= set(row["products"]) and row["machine"] and row["git_commit"]
    for name, prod in row["products"].items():
        assert prod["rows"] == (1 if name.startswith("int4") else int(name.split("x")[1])) and prod["ms"] > 0
        assert prod["of_limit"] == max(prod["of_memory"], prod.get("of_compute", 0))
        ratio = prod["gb_s"] / limits["memory_gb_s"]  # of figures rounded to 0.1 GB/s: their error, and 0.005
        assert abs(prod["of_memory"] - ratio) <= ratio * (0.05 / prod["gb_s"] + 0.05 / limits["memory_gb_s"]) + 0.006
        # the rates are what was read and computed over the time: 2 FLOP a weight a row
        assert abs(prod["gb_s"] - prod["mb"] / prod["ms"]) <= 0.05 + 0.01 * prod["gb_s"]
        assert abs(prod["gflop_s"] - 2 * row["weights"] * prod["rows"] / prod["ms"] / 1e6) <= 0.05 + 0.01 * prod["gflop_s"]
    if "int4 x1" in row["products"]:  # the int4 kernel, where it runs: also timed on weights that stay in cache
        int4 = row["products"]["int4 x1"]
        assert int4["in_cache_gb_s"] > 0 and int4["from_memory_over_in_cache"] > 0


def test_verify_width_times_each_turn_after_an_untimed_forward(monkeypatch):
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("verify_width", ROOT / "scripts" / "verify_width.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    calls, ticks = [], iter(range(100))

    class Clock:
        def now(self):
            calls.append("clock")
            return float(next(ticks))

    monkeypatch.setattr(script, "forward_at", lambda model, cache, tokens, start, **kw: calls.append(len(tokens)))
    configs = [("2", 2, None), ("1", 1, None), ("3/tree", 3, "tree")]
    trees = {3: (None, torch.zeros(3, dtype=torch.long))}
    turn = script.time_turn(None, None, torch.arange(8), 5, configs, trees, Clock())
    # the untimed forward at the first width, then each config between two readings of the clock
    assert calls == [2, "clock", 2, "clock", "clock", 1, "clock", "clock", 3, "clock"]
    assert turn == {"2": 1.0, "1": 1.0, "3/tree": 1.0}


def test_verify_width_times_two_kernels_in_one_rotation(tmp_path):
    from selfspec.kernels import fp16
    from selfspec.kernels.packed import packing_supported

    kernels = ["onednn", "panels"] if fp16.available() and packing_supported() else ["packed", "stock"]
    out = tmp_path / "width.jsonl"
    p = _script("verify_width.py", "--model", "tiny-llama", "--widths", "1", "3", "--reps", "2",
                "--kernels", *kernels, "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and len({r["kernels"] for r in rows}) == 2
    assert rows[0]["over_first_kernel"] == {"1": 1.0, "3": 1.0, "3/tree": 1.0}
    assert all(v > 0 for v in rows[1]["over_first_kernel"].values()) and rows[1]["timed_with"] == [rows[0]["kernels"]]
    if kernels[1] == "panels":
        assert rows[1]["kernels"].startswith("packed fp16 panels") and rows[0]["kernels"] == "packed bf16"


def test_row_attention_ab_renames_the_revision_s_namespaces_and_times_two_kernels():
    import importlib.util

    import torch

    from selfspec.kernels import vnni

    spec = importlib.util.spec_from_file_location("row_attention_ab", ROOT / "scripts" / "row_attention_ab.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    source = script.renamed((ROOT / "selfspec/kernels/csrc/row_attention.cpp").read_text(), "rev0")
    assert "selfspec_vnni" not in source and "namespace selfspec {" not in source
    assert "TORCH_LIBRARY(selfspec_rev0," in source and "TORCH_LIBRARY_IMPL(selfspec_rev0," in source
    assert "namespace selfspec_rev0 {" in source and "selfspec_rev0::attend_heads" in source
    header = script.renamed((ROOT / "selfspec/kernels/csrc/row_attention.h").read_text(), "rev0")
    assert "namespace selfspec_rev0 {" in header
    if not vnni.available():
        pytest.skip(f"C++ kernels: {vnni.unavailable_reason()}")
    same = script.time_kernels({"this": vnni.row_attention, "revision": vnni.row_attention}, 4, 2, 16, 20, 3, reps=1,
                               calls=2)
    ratio, lo, hi = same["this_over_revision"]
    assert same["identical"] and set(same["us"]) == {"this", "revision"} and lo <= ratio <= hi
    other = script.time_kernels({"this": vnni.row_attention, "revision": lambda *a: torch.zeros(3, 4, 16).bfloat16()},
                                4, 2, 16, 20, 3, reps=1, calls=2)
    assert not other["identical"]


def test_two_cores_prices_a_pipelined_round_from_its_measured_parts(tmp_path):
    from selfspec.draft.path import DraftOptions
    from selfspec.draft.spec import DraftSpec
    from selfspec.model.plan import SkipPlan

    path = DraftSpec(SkipPlan(4), DraftOptions(weights="int4", group_size=32), k=2).save(tmp_path / "draft.json")
    out = tmp_path / "two.jsonl"
    p = _script("two_cores.py", "--model", "tiny-llama", "--draft", str(path), "--keys", "16", "--steps", "2", "--rows",
                "3", "--seconds", "0.2", "--reps", "2", "--share", "0", "1", "--threads", "2", "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    t, all_ = row["median_ms"], f"x{row['cores']}"  # on all the cores
    assert set(t) == {f"draft {all_}", f"verify {all_}", f"ar {all_}", "draft x1", "verify x1", "draft together",
                      "verify together"}
    assert all(len(v) == 2 and min(v) > 0 for v in row["runs_ms"].values())  # each configuration once a repetition
    assert row["round_ms"] == pytest.approx(2 * t[f"draft {all_}"] + t[f"verify {all_}"], abs=0.1)
    assert row["overlapped_ms"] == pytest.approx(max(2 * t["draft together"], t["verify together"]), abs=0.1)
    # no round accepted whole: nothing overlaps; all of them: every round costs its overlapped parts
    assert row["bound"]["0.0"] == 1.0
    assert row["bound"]["1.0"] == pytest.approx(row["round_ms"] / row["overlapped_ms"], rel=0.01)
    assert row["break_even_share"] is None or 0 <= row["break_even_share"] <= 1
