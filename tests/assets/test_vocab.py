"""The token ranking behind ``head_ids: frequent`` counts ShareGPT rows that no task set reads."""

import json

import pytest
import yaml

from selfspec.assets.data import load_task_set, packaged_rows_file
from selfspec.assets.vocab import RANK_CONVERSATIONS, assistant_turns
from tests.helpers import CONF


@pytest.mark.integration
def test_the_ranked_conversations_are_no_task_sets_rows():
    turns = assistant_turns()
    rows = packaged_rows_file("sharegpt", "long_conversation").read_text(encoding="utf-8").splitlines()
    ranked = {json.loads(line)["id"] for line in rows[-RANK_CONVERSATIONS:]}
    assert len(ranked) == RANK_CONVERSATIONS and len(turns) > RANK_CONVERSATIONS
    used = set()
    for path in sorted((CONF / "dataset").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        if cfg.get("file") == "sharegpt":
            ts = load_task_set(cfg)
            used |= {s.id.removeprefix("sharegpt/") for s in ts.calibration + ts.eval}
    assert len(used) >= 60 and not used & ranked
