"""selfspec: self-speculative decoding by layer skipping.

A single causal LM drafts tokens with a searched subset of its attention / MLP
sublayers skipped (:class:`SkipPlan`, applied in place by
:func:`layer_skipper`), then verifies them in one full-depth forward on the
same preallocated KV cache (:class:`~selfspec.engine.cache.PositionalKVCache`).
Output is the model's own: token-identical under greedy decoding, the same
distribution under sampling.

Packages: :mod:`selfspec.engine` (cache, decoding loop, verification, stats),
:mod:`selfspec.draft` (skip plans and everything that makes the draft cheaper),
:mod:`selfspec.search` (the Optuna search), :mod:`selfspec.eval` (methods, the
runner, results, tables), :mod:`selfspec.assets` (packaged models and data),
:mod:`selfspec.cli` (entry points; the only code importing hydra, omegaconf or wandb).
"""

from selfspec.draft.skip import layer_skipper
from selfspec.engine.decoding import DecodeConfig, Generation, autoregressive
from selfspec.engine.sampling import SamplingParams
from selfspec.engine.speculate import self_speculative
from selfspec.engine.stats import DecodeStats
from selfspec.errors import AssetError, PlanError, SelfSpecError
from selfspec.model.plan import SkipPlan

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
__version__ = "0.2.0"
