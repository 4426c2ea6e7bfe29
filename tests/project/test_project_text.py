"""Project text speaks of the project: what it does, how, and what was measured; never of the work that built it
(work periods, tracker numbers, the tools of the workplace)."""

import re
import subprocess
from pathlib import Path

from tests.helpers import ROOT

WHERE = ["README.md", "docs", "results", "conf", "selfspec", "scripts", "tests", "experiments", "pyproject.toml"]
# raw results; this file names the patterns
SKIP = re.compile(r"^(results/(runs|optuna|plans)/|tests/project/test_project_text\.py$)")
FORBIDDEN = re.compile(
    r"\bsessions?\b"                                   # a period of work
    r"|\b(?:issues?|goals?|tasks?) #?\d+"                # a tracker's numbers
    r"|duplicates --change|\bsubagents?\b|\bissues (?:list|show|note|resolved|blocked)\b",  # the workplace's tools
    re.IGNORECASE)
ALLOWED = re.compile(r"scope=[\"']session[\"']|start_new_session|pytest_session")  # pytest's and subprocess's words


def _files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "--", *WHERE], capture_output=True, text=True, cwd=ROOT,
                                timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):  # not a git checkout: every file under the folders
        listed = [str(p.relative_to(ROOT)) for w in WHERE for p in (ROOT / w).rglob("*") if p.is_file()]
        listed += [w for w in WHERE if (ROOT / w).is_file()]
    return [ROOT / f for f in listed if not SKIP.match(f) and (ROOT / f).is_file()]


def test_project_text_speaks_of_the_project_only():
    hits = []
    for path in _files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary: figures, studies
        for n, line in enumerate(text.splitlines(), 1):
            if FORBIDDEN.search(ALLOWED.sub("", line)):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "project text speaks of the work, not the project:\n" + "\n".join(hits[:40])


def test_the_check_catches_what_it_is_for():
    word = "sess" + "ion"  # spelt in two parts, so that this file does not hold what it looks for
    for bad in (f"as the thirty-second {word} measured", "see iss" + "ue 13", "go" + "al 2 is met", f"{word.title()}s ago"):
        assert FORBIDDEN.search(bad), bad
    for fine in ('@pytest.fixture(scope="session")', "copy#2", "a draft of 4 tokens", "the issue is latency"):
        assert not FORBIDDEN.search(ALLOWED.sub("", fine)), fine
