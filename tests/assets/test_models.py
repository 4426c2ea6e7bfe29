"""Loading a model: a bad name, cache, file or device gives one clear SelfSpecError, not a traceback from deep inside
torch."""

import pathlib
import time

import pytest
import torch

from selfspec import SelfSpecError
from selfspec.assets.fetch import PackagedFile, fetch_packaged_file
from selfspec.assets.models import encode_prompt, load_model
from selfspec.errors import AssetError


def test_unknown_model_name():
    with pytest.raises(SelfSpecError, match="unknown model 'no-such-model'.*smollm2-135m"):
        load_model("no-such-model")


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


@pytest.mark.cli  # the tokenizer converts in a Python process of its own
def test_a_gguf_transformers_cannot_read_is_an_asset_error(tmp_path, monkeypatch):
    """The conversion's two processes (weights here, tokenizer in a child) each fail with one clear line."""
    from selfspec.assets import models

    bad = tmp_path / "work" / "broken.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF but not really" * 64)
    job = models.TokenizerJob(bad.parent, bad.name, bad.parent / "tokenizer")
    with pytest.raises(AssetError, match="could not load the tokenizer of .*broken.gguf: "):
        job.wait(bad)
    monkeypatch.setattr(models, "fetch_packaged_file", lambda spec, dest: bad)
    jobs, job_of = [], models.TokenizerJob
    monkeypatch.setattr(models, "TokenizerJob", lambda *args: jobs.append(job_of(*args)) or jobs[-1])
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


def test_empty_text_prompt():
    class Tok:
        chat_template = None

    with pytest.raises(SelfSpecError, match="prompt is empty"):
        encode_prompt(Tok(), "   ")
