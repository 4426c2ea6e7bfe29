"""The README's headline block is built from the headline run's table rows and rewritten in place."""

import pytest

from selfspec.errors import SelfSpecError
from selfspec.eval.headline import BEGIN, END, headline_table, update_readme

SETS = ["humaneval", "gsm8k", "mtbench", "summarization", "unseen"]


def _rows():
    rows = []
    for i, d in enumerate(SETS):
        rows.append({"dataset": d, "variant": "default", "method": "autoregressive", "tokens_per_s": 4.0 + i,
                     "speedup": 1.0})
        rows.append({"dataset": d, "variant": "default", "method": "self_speculative", "tokens_per_s": 8.0,
                     "speedup": 2.0 + i / 10, "speedup_ci95": [1.9, 2.3], "greedy_match": 0.5,
                     "over_peer": 1.5, "over_peer_ci95": [1.25, 1.75]})
        rows.append({"dataset": d, "variant": "default", "method": "hf_prompt_lookup-n5", "tokens_per_s": 6.0,
                     "speedup": 1.5, "speedup_ci95": None})
    return rows


def test_headline_table_has_a_line_per_set_and_the_mean_of_the_four():
    md = headline_table(_rows())
    assert "AVX2 search" not in md  # a method the run did not run has no column
    assert "| humaneval | 4.00 | 2.00x ±0.20 | 1.50x | 0.50 | 1.50x (1.25-1.75) |" in md
    assert "| unseen prompt kinds | 8.00 | 2.40x ±0.20 | 1.50x | 0.50 | 1.50x (1.25-1.75) |" in md
    # (2.0 + 2.1 + 2.2 + 2.3) / 4, the unseen kinds not among them
    assert "| **mean of the four** | | **2.15x** | **1.50x** | | |" in md
    assert md.index("summarization") < md.index("mean of the four") < md.index("unseen")
    other = [dict(r, method="self_speculative-avx2", speedup=3.0) for r in _rows() if r["method"] == "self_speculative"]
    md = headline_table(_rows() + other)
    assert "| task set | AR tok/s | searched draft | AVX2 search | prompt lookup |" in md
    assert "| **mean of the four** | | **2.15x** | **3.00x** | **1.50x** | | |" in md


def test_update_readme_rewrites_only_the_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    update_readme(readme, _rows(), "# headline\n\n- command: `x`\n- CPU: y\n\n| table |\n")
    text = readme.read_text()
    assert text.startswith("intro\n" + BEGIN) and text.endswith(END + "\noutro\n")
    assert "old table" not in text and "- command: `x`" in text and "**mean of the four**" in text
    (tmp_path / "other.md").write_text("no block here\n")
    with pytest.raises(SelfSpecError, match="no headline block"):
        update_readme(tmp_path / "other.md", _rows(), "")
