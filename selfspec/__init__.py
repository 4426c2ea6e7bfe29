"""selfspec: self-speculative decoding by layer skipping.

A single causal LM drafts tokens with a searched subset of its attention / MLP
sublayers skipped (:class:`SkipPlan`, applied in place by
:func:`layer_skipper`), then verifies them in one full-depth forward on the
same preallocated KV cache (:class:`PositionalKVCache`). Output is the
model's own: token-identical under greedy decoding, the same distribution
under sampling.
"""

from .decoding import DecodeConfig, Generation, autoregressive, self_speculative
from .errors import AssetError, PlanError, SelfSpecError
from .plan import SkipPlan
from .sampling import SamplingParams
from .skip import layer_skipper
from .stats import DecodeStats

__all__ = [
    "AssetError",
    "DecodeConfig",
    "DecodeStats",
    "Generation",
    "PlanError",
    "SamplingParams",
    "SelfSpecError",
    "SkipPlan",
    "autoregressive",
    "layer_skipper",
    "self_speculative",
]
__version__ = "0.1.0"
