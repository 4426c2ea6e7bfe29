"""Shared fixtures: tiny random models and a tiny model's study, built in-process once per test run."""

import functools
import os
from pathlib import Path

import pytest
import torch

from selfspec.assets.tiny import TINY_ARCHS, tiny_model
from tests.helpers import run_main

# pytest-xdist workers share the cores: each worker, and every process a test starts (through OMP_NUM_THREADS), takes
# its share of them: OpenMP threads that wait on a descheduled sibling slow a tiny model's many small ops (a tiny-model
# search beside one busy core ran 1.86x slower with torch's default two threads, 1.17x with one; docs/log.md).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)


@functools.cache
def _model(arch: str, dtype: torch.dtype, vocab_size: int):
    return tiny_model(arch, dtype=dtype, vocab_size=vocab_size)


@pytest.fixture(params=TINY_ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def model(arch):
    """A tiny fp32 model of each architecture (shared across tests; never mutated)."""
    return _model(arch, torch.float32, 96)


@pytest.fixture
def make_model():
    return lambda arch, dtype=torch.float32, vocab_size=96: _model(arch, dtype, vocab_size)


@pytest.fixture(scope="session")
def tiny_study(tmp_path_factory) -> Path:
    """A quick search's study of the tiny Llama (fp32), its draft in ``plans/`` beside it."""
    from selfspec.cli.search import main

    root = tmp_path_factory.mktemp("study")
    search = run_main(main, "model=tiny-llama", "search=quick", "logger=none", f"search.storage={root}/study.db",
                      f"plans_dir={root}/plans", f"hydra.run.dir={root}/hydra")
    assert search.returncode == 0
    return root / "study.db"
