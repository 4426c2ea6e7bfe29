"""python -m selfspec.generate: bad input is one clear line, before any work."""

import subprocess
import sys

import pytest

from selfspec.cli.generate import main as generate_main


@pytest.mark.parametrize("n", ["0", "-3"])
def test_generate_refuses_no_new_tokens_before_loading_anything(n, capsys):
    assert generate_main(["--model", "no-such-model", "--max-new-tokens", n]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: --max-new-tokens must be >= 1, got {n}"


def test_cli_prints_one_line_error():
    proc = subprocess.run(
        [sys.executable, "-m", "selfspec.generate", "--model", "no-such-model"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown model 'no-such-model'")
    assert "Traceback" not in proc.stderr
