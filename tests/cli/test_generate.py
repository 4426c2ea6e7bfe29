"""python -m selfspec.generate: end to end on a tiny model as its own process; bad input is one clear line, before
any work."""

import json
import subprocess
import sys

import pytest

from selfspec.cli.generate import main as generate_main


@pytest.mark.cli
def test_generate_decodes_one_prompt_both_ways(tmp_path):
    p = subprocess.run([sys.executable, "-m", "selfspec.generate", "--model", "tiny-llama", "--dtype", "float32",
                        "--skip-attn", "1", "--max-new-tokens", "12", "--show-sources", "--json"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "[command line]" in p.stdout and "outputs token-identical" in p.stdout  # fp32 greedy
    summary = json.loads(p.stdout.splitlines()[-1])
    assert summary["identical"] is True and summary["speedup"] > 0
    assert summary["self_speculative"]["new_tokens"] == summary["autoregressive"]["new_tokens"] > 0


@pytest.mark.parametrize("n", ["0", "-3"])
def test_generate_refuses_no_new_tokens_before_loading_anything(n, capsys):
    assert generate_main(["--model", "no-such-model", "--max-new-tokens", n]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"error: --max-new-tokens must be >= 1, got {n}"


def test_cli_prints_one_line_error(capsys):
    assert generate_main(["--model", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown model 'no-such-model'") and len(err.splitlines()) == 1
    assert "Traceback" not in err
