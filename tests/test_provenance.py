"""Result rows: one strict-JSON line each, with where they came from."""

import json

from selfspec.provenance import append_row, git_commit, provenance, strict_json


def test_append_row_writes_strict_json_with_provenance(tmp_path):
    out = tmp_path / "deep" / "rows.jsonl"
    append_row(out, {"x": float("nan"), "y": [1.0, float("inf")], "z": {"w": -float("inf")}}, echo=False)
    append_row(out, {"x": 2.5, "git_commit": "given"}, echo=False)
    first, second = (json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
                     for line in out.read_text().splitlines())
    assert (first["x"], first["y"], first["z"]) == (None, [1.0, None], {"w": None})
    assert first["machine"]["cores"] and first["time"] and "git_commit" in first
    assert second["x"] == 2.5 and second["git_commit"] == "given"  # a row's own provenance is kept


def test_strict_json_leaves_finite_values_alone():
    value = {"a": [1, 2.5, "s", None, True], "b": (0.0,)}
    assert strict_json(value) == {"a": [1, 2.5, "s", None, True], "b": [0.0]}


def test_outside_a_git_checkout_the_commit_is_null(tmp_path, monkeypatch):
    """A copy of the code without .git (an unpacked release, a wheel) records no commit, and says so plainly."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # nor a checkout that holds the folder
    monkeypatch.chdir(tmp_path)
    assert git_commit() is None and git_commit(tmp_path) is None
    assert provenance()["git_commit"] is None
    append_row(tmp_path / "rows.jsonl", {"x": 1}, echo=False)
    assert json.loads((tmp_path / "rows.jsonl").read_text())["git_commit"] is None

