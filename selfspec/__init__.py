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

import importlib

# the public names, imported on first use: `import selfspec` alone loads no torch, so an entry point can take
# Ctrl-C quietly from its first line on (selfspec.cli)
_EXPORTS = {
    "layer_skipper": "selfspec.draft.skip",
    "DecodeConfig": "selfspec.engine.decoding",
    "Generation": "selfspec.engine.decoding",
    "autoregressive": "selfspec.engine.decoding",
    "SamplingParams": "selfspec.engine.sampling",
    "self_speculative": "selfspec.engine.speculate",
    "DecodeStats": "selfspec.engine.stats",
    "AssetError": "selfspec.errors",
    "PlanError": "selfspec.errors",
    "SelfSpecError": "selfspec.errors",
    "SkipPlan": "selfspec.model.plan",
}


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'selfspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


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
