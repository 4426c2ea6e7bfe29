"""Bad input is one clear line, before any work: a misspelt draft field, a zero token budget."""

import json

import pytest

from selfspec.cli.generate import main as generate_main
from selfspec.draft.spec import DraftSpec
from selfspec.errors import PlanError
from selfspec.model.plan import SkipPlan


def test_a_misspelt_top_level_field_of_a_draft_file_is_refused(tmp_path):
    path = tmp_path / "draft.json"
    DraftSpec(SkipPlan(4, mlp=(1,), model="tiny-llama")).save(path)
    data = json.loads(path.read_text())
    DraftSpec.load(path)  # as written: loads
    data["mpl"] = data.pop("mlp")
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"unknown field\(s\) 'mpl' \(did you mean 'mlp'\?\)"):
        DraftSpec.load(path)


@pytest.mark.parametrize("n", ["0", "-3"])
def test_generate_refuses_no_new_tokens_before_loading_anything(n, capsys):
    assert generate_main(["--model", "no-such-model", "--max-new-tokens", n]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: --max-new-tokens must be >= 1, got {n}"
