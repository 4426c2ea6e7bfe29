"""Shared fixtures: tiny random models built in-process, cached per session."""

import functools

import pytest
import torch

from selfspec.assets.tiny import TINY_ARCHS, tiny_model


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


PROMPT = list(range(3, 20))
