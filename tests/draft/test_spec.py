"""The draft file: round trips, older skip-plan files, clear errors on hand-edited files."""

import json

import pytest

from selfspec import PlanError, SkipPlan
from selfspec.draft.path import DraftOptions
from selfspec.draft.spec import DraftSpec

FULL = DraftSpec(SkipPlan(6, attn=(1, 3), mlp=(2,), model="m", provenance={"git_commit": "x"}),
                 DraftOptions(weights="int4", group_size=128, head_tokens=16384, ngram=3, copy_tokens=10),
                 k=4, adaptive=True, threshold=0.4, measured={"calibration": {"speedup": 1.5}})


def test_round_trip(tmp_path):
    path = FULL.save(tmp_path / "d.json")
    back = DraftSpec.load(path)
    assert back == FULL and back.measured == FULL.measured and back.plan.provenance == {"git_commit": "x"}
    assert json.loads(path.read_text())["format"] == "selfspec.draft/2"


def test_a_quantized_draft_head_round_trips_and_names_itself(tmp_path):
    spec = FULL.replace(options=DraftOptions(weights="int4", group_size=128, head_tokens=16384, head_weights="int4"))
    back = DraftSpec.load(spec.save(tmp_path / "d.json"))
    assert back == spec and back.key != FULL.replace(options=DraftOptions(weights="int4", group_size=128,
                                                                        head_tokens=16384)).key
    assert "head 16384 int4 g128" in back.describe()
    assert "head full int8" in FULL.replace(options=DraftOptions(head_weights="int8")).describe()
    old = FULL.to_dict()
    del old["options"]["head_weights"]  # a file written before the option existed
    assert DraftSpec.from_dict(old).options.head_weights == "model"


def test_a_growing_draft_round_trips_and_is_another_draft(tmp_path):
    grow = FULL.replace(k_max=8)
    back = DraftSpec.load(grow.save(tmp_path / "d.json"))
    assert back == grow and back.k_max == 8 and back.length["k_max"] == 8
    assert back.key != FULL.key and "k=4 growing to 8" in back.describe()
    assert "k_max" not in FULL.to_dict()  # a fixed k writes the file as before, and keeps its key
    assert FULL.replace(k_max=4).key == FULL.key and FULL.replace(k_max=3).to_dict() == FULL.to_dict()  # cannot grow
    assert (grow.longest_draft, FULL.replace(k_max=3).longest_draft) == (8, 4)  # k = 4


def test_a_fixed_threshold_round_trips_and_is_another_draft(tmp_path):
    fixed = FULL.replace(threshold_step=0.0)
    back = DraftSpec.load(fixed.save(tmp_path / "d.json"))
    assert back == fixed and back.length["threshold_step"] == 0.0 and "adaptive 0.40 fixed" in back.describe()
    assert back.key != FULL.key and "threshold_step" not in FULL.to_dict()  # the default writes the file as before
    assert FULL.length["threshold_step"] == 0.05 and "fixed" not in FULL.describe()
    assert FULL.replace(adaptive=False, threshold_step=0.0).key == FULL.replace(adaptive=False).key  # no exit: unused


def test_an_older_skip_plan_file_loads_as_a_draft(tmp_path):
    path = SkipPlan(6, attn=(2,), provenance={"k": 3}).save(tmp_path / "p.json")
    spec = DraftSpec.load(path)
    assert spec.plan.attn == (2,) and spec.k == 3 and spec.options == DraftOptions() and not spec.adaptive


@pytest.mark.parametrize("edit, message", [
    (lambda d: [], "holds list"),
    (lambda d: {**d, "attn": None}, "attn must be a list"),
    (lambda d: {**d, "k": "four"}, "k must be an integer"),
    (lambda d: {**d, "k_max": -2}, "k_max must be an integer"),
    (lambda d: {**d, "threshold_step": 1.5}, "threshold_step must be a number"),
    (lambda d: {**d, "provenance": [1]}, "provenance must be an object"),
    (lambda d: {**d, "options": {"weights": "int3"}}, "draft weights must be one of"),
    (lambda d: {**d, "options": {"wieghts": "int4"}}, "unexpected keyword"),
    (lambda d: {**d, "format": "other/1"}, "not a selfspec draft"),
])
def test_hand_edited_files_give_one_clear_error(tmp_path, edit, message):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(edit(FULL.to_dict())))
    with pytest.raises(PlanError, match=message):
        DraftSpec.load(path)


def test_a_misspelt_top_level_field_of_a_draft_file_is_refused(tmp_path):
    path = tmp_path / "draft.json"
    DraftSpec(SkipPlan(4, mlp=(1,), model="tiny-llama")).save(path)
    data = json.loads(path.read_text())
    DraftSpec.load(path)  # as written: loads
    data["mpl"] = data.pop("mlp")
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"unknown field\(s\) 'mpl' \(did you mean 'mlp'\?\)"):
        DraftSpec.load(path)
