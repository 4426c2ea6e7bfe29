"""Task sets load: inline, JSON, ShareGPT and mixed sets, their splits, and the rows' references."""

import json

import pytest
import yaml

from selfspec import SelfSpecError
from selfspec.assets.data import asks_for_summary, history, load_task_set, sharegpt_conversations, sharegpt_first_turns
from tests.helpers import CONF, HUMANEVAL_REF


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


def test_long_conversations_keep_a_history_that_ends_with_a_user_turn(tmp_path):
    def turn(who, n, text="x"):
        return {"from": who, "value": text * n}

    opts = {"min_chars": 100, "max_chars": 400}
    conv = {"id": "a", "turns": [turn("human", 60), turn("gpt", 60), turn("human", 60), turn("gpt", 200),
                                 turn("human", 10), turn("gpt", 500)]}
    assert [len(t["value"]) for t in history(conv, opts)] == [60, 60, 60, 200, 10]  # 390 chars, to the last user turn
    assert history({**conv, "turns": conv["turns"][:2]}, opts) == []  # no user turn after an answer
    assert history(conv, {**opts, "max_chars": 150}) == []  # within 150 chars: 120, under min_chars
    assert history(conv, {**opts, "code_only": True}) == []
    coded = {**conv, "turns": [turn("human", 1, "```py\nx = 1\n```" * 10), *conv["turns"][1:]]}
    assert history(coded, {**opts, "code_only": True})
    src = tmp_path / "sg.json"
    src.write_text(json.dumps([{"id": "a", "conversations": conv["turns"]},
                               {"id": "b", "conversations": [turn("gpt", 5)]}]))
    rows = [json.loads(line) for line in sharegpt_conversations(src, tmp_path / "c.jsonl").read_text().splitlines()]
    assert rows == [conv]
    path = tmp_path / "rows.jsonl"
    other = {**conv, "id": "b", "turns": [*conv["turns"][:4], turn("human", 10, "y"), turn("gpt", 5)]}
    path.write_text("\n".join(json.dumps(r) for r in [conv, other, {**conv, "id": "c", "turns": []}]))
    ts = load_task_set({"name": "long", "source": "json", "path": str(path), "format": "long_conversation",
                        "options": opts, "calibration": {"n": 1}, "eval": {"offset": 1, "n": 1}})
    (sample,) = ts.eval
    assert sample.id == "sharegpt/b" and sample.turns[0].count("User: ") == 3 and sample.turns[0].endswith("User: " + "y" * 10)
    assert "Assistant: " + "x" * 200 in sample.turns[0]


def test_summarization_filter():
    body = "word " * 400
    assert asks_for_summary({"text": "Summarize this article:\n" + body}, {})
    assert asks_for_summary({"text": body + "\nPlease write a short summary."}, {})
    assert not asks_for_summary({"text": "Summarize: short"}, {})
    assert not asks_for_summary({"text": "Read this, don't summarize it yet.\n" + body}, {})
    assert not asks_for_summary({"text": body[:800] + " summary " + body[:800]}, {})  # only in the middle


@pytest.mark.integration
@pytest.mark.parametrize("name", ["humaneval", "gsm8k", "mtbench", "summarization", "longchat", "longcode"])
def test_packaged_task_sets(name):
    ts = load_task_set(yaml.safe_load((CONF / "dataset" / f"{name}.yaml").read_text()))
    assert len(ts.calibration) >= 8 and len(ts.eval) >= 10
    assert not {s.id for s in ts.calibration} & {s.id for s in ts.eval}
    if name == "mtbench":
        assert all(len(s.turns) == 2 for s in ts.eval)


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


def test_task_set_rows_carry_their_references():
    from selfspec.assets.data import FORMATS

    he = FORMATS["humaneval"]({"task_id": "HumanEval/0", **HUMANEVAL_REF}, 0, {})
    assert he.reference["entry_point"] == "add" and HUMANEVAL_REF["prompt"] in he.turns[0]
    gsm = FORMATS["gsm8k"]({"question": "How many?", "answer": "#### 3"}, 7, {})
    assert gsm.reference == {"answer": "#### 3"} and gsm.id == "gsm8k/7"
