"""Every results file is valid for any reader: strict JSON (no NaN or Infinity), one object a line in JSONL."""

import json

import pytest

from tests.helpers import ROOT

RESULTS = ROOT / "results"


def _refuse(constant: str):
    raise ValueError(f"{constant} is not JSON")


def _files():
    return sorted([*RESULTS.rglob("*.jsonl"), *RESULTS.rglob("*.json")])


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(RESULTS)))
def test_results_files_are_strict_json(path):
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        assert text.endswith("\n"), "a torn last line"
        for n, line in enumerate(text.splitlines(), 1):
            assert isinstance(json.loads(line, parse_constant=_refuse), dict), f"line {n}"
    else:
        json.loads(text, parse_constant=_refuse)


def test_csv_tables_hold_no_nan():
    for path in RESULTS.glob("tables/*.csv"):
        cells = {c.strip().lower() for line in path.read_text().splitlines() for c in line.split(",")}
        assert not cells & {"nan", "inf", "-inf", "infinity"}, path.name
