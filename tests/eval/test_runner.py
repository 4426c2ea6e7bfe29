"""The evaluation runner on bad input and after a crash."""

import json

import pytest
import yaml

from selfspec import DecodeConfig, SelfSpecError, SkipPlan
from selfspec.assets.data import Sample, TaskSet, load_task_set
from selfspec.assets.models import load_model
from selfspec.cli.config import conf_dir
from selfspec.eval.methods import build_method
from selfspec.eval.records import summarize
from selfspec.eval.runner import EvalSettings, evaluate, short_name


@pytest.fixture(scope="module")
def lm():
    return load_model("tiny-llama", dtype="float32")


@pytest.fixture(scope="module")
def tasks():
    return load_task_set(yaml.safe_load((conf_dir() / "dataset" / "tiny.yaml").read_text()))


def _run(lm, tasks, path, n, methods=("autoregressive",), max_new_tokens=6, reps=1):
    cfg = DecodeConfig(max_new_tokens=max_new_tokens)
    plan = SkipPlan(lm.num_layers, attn=[1], model=lm.name)
    built = [build_method(m, lm, cfg, plan if m == "self_speculative" else None) for m in methods]
    return evaluate(lm, tasks, built, EvalSettings(path, n_samples=n, warmup_tokens=2, reps=reps), {"model": lm.name})


def test_passes_interleave_and_a_run_extended_to_more_passes_resumes_with_the_missing_ones(lm, tasks, tmp_path):
    path = tmp_path / "samples.jsonl"
    methods = ("autoregressive", "self_speculative")
    _run(lm, tasks, path, 2, methods=methods)
    rows = _run(lm, tasks, path, 2, methods=methods, reps=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()[1:]]
    # pass 0 was there; passes 1 and 2 were appended in order, each over both samples and both methods
    assert [(r["rep"], r["sample_id"]) for r in lines[::2]] == [(p, s) for p in range(3) for s in ("tiny/e0", "tiny/e1")]
    assert len(rows) == len(lines) == 12
    again = _run(lm, tasks, path, 2, methods=methods, reps=3)  # nothing left to do: nothing appended
    assert json.dumps(again) == json.dumps(rows) and len(path.read_text().splitlines()) == 13
    s = summarize(rows, "autoregressive")
    assert s["autoregressive"]["samples"] == 2 and s["autoregressive"]["reps"] == 3
    assert len(s["self_speculative"]["speedup_reps"]) == 3 and s["self_speculative"]["drift"] > 0
    assert s["self_speculative"]["greedy_match"] == 1.0  # fp32 greedy: every pass equals AR's same pass


@pytest.mark.parametrize("reps", [0, -2, True, 1.5])
def test_reps_must_be_a_positive_integer(tmp_path, reps):
    with pytest.raises(SelfSpecError, match="reps must be an integer >= 1"):
        EvalSettings(tmp_path / "s.jsonl", reps=reps)


def test_a_torn_last_line_is_dropped_before_resuming(lm, tasks, tmp_path):
    path = tmp_path / "samples.jsonl"
    _run(lm, tasks, path, 1)
    with open(path, "a") as f:
        f.write('{"type": "sample", "sample_id": "tiny/e1", "meth')  # killed mid-write
    rows = _run(lm, tasks, path, 2)
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # every line is whole JSON again
    assert len(lines) == 1 + 2 and len(rows) == 2
    assert summarize(rows, "autoregressive")["autoregressive"]["samples"] == 2


def test_a_sample_torn_after_its_first_row_is_decoded_again_without_a_doubled_row(lm, tasks, tmp_path):
    """A full disk or a kill mid-write can leave a sample's first row whole and the next one torn: the whole
    sample is decoded again on resume, so its lone first row must go, or (sample, method) would be there twice."""
    path = tmp_path / "samples.jsonl"
    methods = ("autoregressive", "self_speculative")
    _run(lm, tasks, path, 1, methods=methods)
    first = path.read_text().splitlines()[1]  # e0's autoregressive row, as if e1's had been written that far
    with open(path, "a") as f:
        f.write(first.replace("tiny/e0", "tiny/e1") + "\n" + '{"type": "sample", "sample_id": "tiny/e1", "met')
    rows = _run(lm, tasks, path, 2, methods=methods)
    keys = [(r["sample_id"], r["method"]) for r in map(json.loads, path.read_text().splitlines()[1:])]
    assert len(keys) == len(set(keys)) == 4 and len(rows) == 4
    assert summarize(rows, "autoregressive")["self_speculative"]["samples"] == 2


def test_repair_cuts_only_a_last_sample_that_lacks_methods(tmp_path):
    from selfspec.eval.records import repair_torn_tail

    def line(sample, method):
        return json.dumps({"type": "sample", "sample_id": sample, "method": method}) + "\n"

    path = tmp_path / "samples.jsonl"
    whole = '{"type": "header"}\n' + line("a", "m1") + line("a", "m2")
    path.write_text(whole + line("b", "m1") + '{"type": "sam')
    assert repair_torn_tail(path, ["m1", "m2"]) == 2 and path.read_text() == whole
    assert repair_torn_tail(path, ["m1", "m2"]) == 0 and path.read_text() == whole  # a whole last sample stays
    path.write_text(whole + line("b", "m1"))
    assert repair_torn_tail(path) == 0  # without the methods only a partial line goes
    assert repair_torn_tail(path, ["m1", "m2"]) == 1 and path.read_text() == whole


def test_a_method_listed_twice_is_refused(lm, tasks, tmp_path):
    with pytest.raises(SelfSpecError, match="autoregressive more than once"):
        _run(lm, tasks, tmp_path / "s.jsonl", 1, methods=("autoregressive", "autoregressive"))


def test_zero_new_tokens_is_refused_before_anything_is_written(lm, tasks, tmp_path):
    with pytest.raises(SelfSpecError, match="max_new_tokens >= 1"):
        _run(lm, tasks, tmp_path / "s.jsonl", 1, max_new_tokens=0)
    assert not (tmp_path / "s.jsonl").exists()


@pytest.mark.parametrize("n", [0, -1, "abc", 1.5, True])
def test_n_samples_must_be_a_positive_integer(tmp_path, n):
    with pytest.raises(SelfSpecError, match=r"n_samples must be an integer >= 1 \(or null for all\), got"):
        EvalSettings(tmp_path / "s.jsonl", n_samples=n)


@pytest.mark.parametrize("w", [-1, "abc", 2.5])
def test_warmup_tokens_must_be_an_integer(tmp_path, w):
    with pytest.raises(SelfSpecError, match="warmup_tokens must be an integer >= 0, got"):
        EvalSettings(tmp_path / "s.jsonl", warmup_tokens=w)


def test_an_evaluation_has_one_seed_the_one_that_seeds_sampling():
    """`seed=` would be recorded without changing a draw: an evaluation has only decoding.seed, which the record
    names."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    from selfspec.cli.config import decode_config

    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        assert decode_config(compose(config_name="evaluate", overrides=["decoding.seed=5"]), 8, None).seed == 5
        with pytest.raises(ConfigCompositionException, match="seed"):
            compose(config_name="evaluate", overrides=["seed=3"])


def test_an_unknown_method_option_is_one_clear_error(lm):
    with pytest.raises(SelfSpecError, match="unknown key num_token in method_options.hf_prompt_lookup"):
        build_method("hf_prompt_lookup", lm, DecodeConfig(), options={"num_token": 5})
    with pytest.raises(SelfSpecError, match="takes no options"):
        build_method("autoregressive", lm, DecodeConfig(), options={"k": 2})


def test_a_second_writer_of_one_run_folder_is_refused(lm, tasks, tmp_path):
    from selfspec.locks import exclusive

    path = tmp_path / "samples.jsonl"
    with exclusive(path, "held by a test"):
        with pytest.raises(SelfSpecError, match="being written by another process"):
            _run(lm, tasks, path, 1)
    assert not path.exists()
    assert len(_run(lm, tasks, path, 1)) == 1  # released: the next run writes


def test_a_sample_that_cannot_be_decoded_is_skipped_with_its_id_and_the_run_goes_on(lm, tmp_path, capsys):
    ok = Sample("t/ok", ("Write one short line.",))
    long = Sample("t/long", ("x" * 600,))  # the tiny model's context is 512 positions
    empty = Sample("t/empty", ("   ",))
    ts = TaskSet("t", (Sample("t/c", ("calibration",)),), (long, empty, ok), max_new_tokens=6)
    path = tmp_path / "samples.jsonl"
    cfg = DecodeConfig(max_new_tokens=6)
    plan = SkipPlan(4, attn=(1,), model="tiny-llama")
    methods = [build_method(m, lm, cfg, plan) for m in ("autoregressive", "self_speculative")]
    rows = evaluate(lm, ts, methods, EvalSettings(path, warmup_tokens=2), {"model": lm.name})
    err = capsys.readouterr().err
    assert {r["sample_id"] for r in rows} == {ok.id} and len(rows) == 2
    assert "sample t/long skipped: the prompt has" in err and "max_new_tokens=6" in err
    assert "sample t/empty skipped: a user turn is empty" in err
    before = path.read_text()
    evaluate(lm, ts, methods, EvalSettings(path, warmup_tokens=2), {"model": lm.name})
    assert path.read_text() == before  # a resume does not try the skipped samples again


def test_a_plan_of_another_model_of_the_same_depth_is_refused(lm):
    with pytest.raises(SelfSpecError, match="made for model 'tiny-qwen2', not 'tiny-llama'"):
        build_method("self_speculative", lm, DecodeConfig(), SkipPlan(4, attn=(1,), model="tiny-qwen2"))


def test_packed_weights_off_the_cpu_is_one_clear_error():
    meta = load_model("tiny-llama")
    meta.model.to("meta")  # stands for a GPU: no device here can run the oneDNN kernels but the CPU
    with pytest.raises(SelfSpecError, match="packed_weights uses CPU .*decoding.packed_weights=false"):
        build_method("autoregressive", meta, DecodeConfig())


def test_method_variants_take_their_methods_options_and_their_own(lm):
    from selfspec.eval.methods import method_options, split_variant

    options = {"hf_prompt_lookup": {"num_tokens": 5, "max_ngram": 3}, "hf_prompt_lookup-short": {"num_tokens": 2}}
    assert split_variant("hf_prompt_lookup_stock-short") == ("hf_prompt_lookup_stock", "short")
    assert method_options("hf_prompt_lookup-short", options) == {"num_tokens": 2, "max_ngram": 3}
    assert method_options("hf_prompt_lookup_stock-short", options) == {"num_tokens": 5, "max_ngram": 3}
    assert method_options("hf_prompt_lookup", options) == {"num_tokens": 5, "max_ngram": 3}
    m = build_method("hf_prompt_lookup-short", lm, DecodeConfig(max_new_tokens=4),
                     options=method_options("hf_prompt_lookup-short", options))
    assert m.name == "hf_prompt_lookup-short" and m.info["num_tokens"] == 2
    for bad in ("hf_prompt_lookup-", "nope-x", "hf_prompt_lookup-a.b"):
        with pytest.raises(SelfSpecError, match="unknown method"):
            build_method(bad, lm, DecodeConfig())


def test_a_method_variant_may_pad_its_own_forwards(lm):
    cfg = DecodeConfig(max_new_tokens=4, k=2)
    m = build_method("autoregressive-wide", lm, cfg, options={"decoding": {"rows": 3, "row_invariant": False}})
    assert m.cfg.rows == 3 and not m.cfg.row_invariant and m.cfg.k == 2 and m.cfg.max_new_tokens == 4
    assert build_method("autoregressive", lm, cfg).cfg.rows == cfg.rows
    with pytest.raises(SelfSpecError, match="may set rows, row_invariant"):
        build_method("autoregressive-x", lm, cfg, options={"decoding": {"max_new_tokens": 9}})
    with pytest.raises(SelfSpecError, match="applies to our own loop"):
        build_method("hf_generate-x", lm, cfg, options={"decoding": {"rows": 3}})


def test_speedups_pair_each_repetition_with_the_baselines_same_repetition():
    from selfspec.engine.harness import paired_ratios, speedups
    from selfspec.engine.stats import DecodeStats

    def rep(tokens_per_s: float, tpot: float) -> DecodeStats:
        return DecodeStats(method="m", requests=1, new_tokens=11, total_time=11 / tokens_per_s, ttft=11 / tokens_per_s
                           - 10 * tpot)

    # the machine slows down 2x after the first repetition; the draft is 1.5x as fast as AR in each
    per_rep = {"ar": [rep(10, 0.09), rep(5, 0.18), rep(5, 0.18)], "d": [rep(15, 0.06), rep(7.5, 0.12), rep(7.5, 0.12)]}
    assert paired_ratios(per_rep, "d", "ar") == pytest.approx([1.5] * 3)
    assert paired_ratios(per_rep, "d", "ar", "tpot_s") == pytest.approx([1.5] * 3)
    assert speedups(per_rep, "ar") == pytest.approx({"ar": 1.0, "d": 1.5})
    # the slowdown lands between AR and the draft inside the second repetition: paired ratios 1.5, 0.75, 1.5
    # give 1.5; the ratio of unpaired medians (draft 7.5 over AR 10) would say 0.75
    per_rep = {"ar": [rep(10, 0.09), rep(10, 0.09), rep(5, 0.18)], "d": [rep(15, 0.06), rep(7.5, 0.12), rep(7.5, 0.12)]}
    assert speedups(per_rep, "ar")["d"] == pytest.approx(1.5)


def test_progress_bar_names_keep_variants_apart():
    names = ["autoregressive", "self_speculative", "self_speculative-min2", "self_speculative-min1",
             "hf_prompt_lookup-n5", "hf_prompt_lookup_stock", "hf_assisted-n8"]
    short = [short_name(n) for n in names]
    assert short[:4] == ["ar", "ours", "ours-min2", "ours-min1"]
    assert len(set(short)) == len(names)


def test_the_console_table_keeps_long_variant_names_in_their_column(capsys):
    from selfspec.cli.evaluate import print_summary

    row = {"samples": 3, "tokens_per_s": 9.5, "speedup": 1.5, "acceptance_rate": 0.7, "mean_accepted_length": 4.2,
           "greedy_match": 1.0, "reps": 1, "drift": float("nan")}
    print_summary({"autoregressive": row, "self_speculative-min2-longer": row}, "autoregressive")
    head, first, second = capsys.readouterr().out.splitlines()[:3]
    end = head.index("samples") + len("samples")
    assert first[end - 1] == "3" == second[end - 1] and first[end] == " " == second[end]


def test_interleaved_shows_a_bar_of_its_timed_runs_only_when_labelled(capsys):
    from selfspec.engine.decoding import Generation
    from selfspec.engine.harness import interleaved
    from selfspec.engine.stats import DecodeStats

    calls = []

    def runner(name):
        def run(ids, max_new_tokens):
            calls.append((name, max_new_tokens))
            return Generation(tokens=[1], stats=DecodeStats(method=name, requests=1, new_tokens=1, total_time=0.1))
        return run

    runs = {"a": runner("a"), "b": runner("b")}
    out = interleaved(runs, [[1], [2], [3]], reps=2, warmup_tokens=2, progress="re-timing")
    assert [len(v) for v in out.values()] == [2, 2]
    assert len(calls) == 2 + 2 * 3 * 2  # one warm-up each, then every method on every prompt, twice
    err = capsys.readouterr().err
    assert "re-timing" in err and "12/12" in err
    interleaved(runs, [[1]], warmup_tokens=0)
    assert capsys.readouterr().err == ""


def test_build_method_takes_typed_options_and_refuses_another_methods(lm):
    from selfspec.draft.path import DraftOptions
    from selfspec.eval.methods import PromptLookupOptions

    cfg = DecodeConfig(max_new_tokens=4)
    m = build_method("self_speculative", lm, cfg, SkipPlan(lm.num_layers, model=lm.name), DraftOptions(weights="int8"),
                     decoding={"k": 2})
    assert m.cfg.k == 2
    with pytest.raises(SelfSpecError, match="takes DraftOptions, got PromptLookupOptions"):
        build_method("self_speculative", lm, cfg, None, PromptLookupOptions())
