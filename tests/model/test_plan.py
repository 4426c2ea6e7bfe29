"""SkipPlan validation, JSON round trip, a plan made for another model."""

import json

import pytest

from selfspec import DecodeConfig, PlanError, SkipPlan, self_speculative
from tests.helpers import PROMPT


def test_json_round_trip(tmp_path):
    plan = SkipPlan(28, attn=(5, 2), mlp=(3,), model="qwen2.5-coder-1.5b", provenance={"objective": 1.23})
    path = plan.save(tmp_path / "plans" / "p.json")
    loaded = SkipPlan.load(path)
    assert loaded == plan and loaded.attn == (2, 5)
    assert loaded.provenance == {"objective": 1.23}
    assert json.loads(path.read_text())["format"] == "selfspec.skip_plan/1"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_layers=4, attn=(4,)), "outside 0..3"),
        (dict(num_layers=4, mlp=(-1,)), "outside"),
        (dict(num_layers=4, attn=(1, 1)), "twice"),
        (dict(num_layers=2, attn=(0, 1), mlp=(0, 1)), "every sublayer"),
        (dict(num_layers=0), "positive"),
        (dict(num_layers=4, attn=("1",)), "integer"),
    ],
)
def test_invalid_plans(kwargs, match):
    with pytest.raises(PlanError, match=match):
        SkipPlan(**kwargs)


def test_plan_for_other_model_rejected():
    with pytest.raises(PlanError, match="made for a 30-layer model"):
        SkipPlan(30, attn=(1,)).check_model(28)


def test_bad_files(tmp_path):
    with pytest.raises(PlanError, match="no plan file"):
        SkipPlan.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(PlanError, match="not a selfspec skip plan"):
        SkipPlan.load(bad)


def test_plan_errors(model):
    with pytest.raises(PlanError, match="every sublayer"):
        SkipPlan(4, attn=(0, 1, 2, 3), mlp=(0, 1, 2, 3))
    with pytest.raises(PlanError, match="made for a 30-layer model"):
        self_speculative(model, PROMPT, SkipPlan(30, attn=(1,)), DecodeConfig())
