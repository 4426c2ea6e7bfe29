"""Fixtures of the search tests: the tiny model and a simulator of its rounds on the toy prompts."""

import pytest

from selfspec import DecodeConfig, autoregressive
from selfspec.assets.tiny import TINY_VOCAB, tiny_model
from selfspec.search.simulate import RoundSimulator
from tests.search.toy import PROMPTS


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def simulator(tiny):
    conts = [autoregressive(tiny, p, DecodeConfig(max_new_tokens=12)).tokens for p in PROMPTS]
    return RoundSimulator(tiny, PROMPTS, conts)

