"""Decoding methods behind one interface, for the evaluation runner.

A :class:`Method` turns prompt ids into a :class:`~selfspec.decoding.Generation`
(new tokens and :class:`~selfspec.stats.DecodeStats`). Our own
``autoregressive`` and ``self_speculative`` share one forward, one token count
and one clock (:mod:`selfspec.decoding`); the transformers baselines
(:mod:`selfspec.baselines`) are timed with the same :class:`~selfspec.stats.Clock`
and count new tokens the same way (EOS included, cut at ``max_new_tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .decoding import DecodeConfig, Generation, autoregressive, self_speculative
from .draft import DraftOptions, DraftPath
from .errors import SelfSpecError
from .models import LoadedModel
from .packed import weight_packer
from .plan import SkipPlan


@dataclass
class Method:
    """A named decoder bound to one loaded model.

    ``extra_memory_bytes`` is what the method keeps beside the model's own
    weights (a second model, a quantized copy, ...), measured when it is built.
    """

    name: str
    run: Callable[[list[int], DecodeConfig], Generation]
    cfg: DecodeConfig
    plan: SkipPlan | None = None
    extra_memory_bytes: int = 0
    info: dict | None = None

    def generate(self, prompt_ids: list[int], max_new_tokens: int | None = None) -> Generation:
        cfg = self.cfg if max_new_tokens is None else replace(self.cfg, max_new_tokens=max_new_tokens)
        gen = self.run(list(prompt_ids), cfg)
        gen.stats.method = self.name
        return gen


def _packed_bytes(lm: LoadedModel, cfg: DecodeConfig) -> int:
    """Packs the weights now (not inside a timed request) and returns the copies' size.

    With ``packed_only`` the dense weights are freed now and only the packed
    copies of weights that must stay dense count (the LM head's, tied ones).
    """
    return weight_packer(lm.model, not cfg.packed_only).extra_bytes if cfg.packed_weights else 0


def _autoregressive(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: dict) -> Method:
    return Method("autoregressive", lambda ids, c: autoregressive(lm.model, ids, c, lm.eos_ids), cfg,
                  extra_memory_bytes=_packed_bytes(lm, cfg))


def _self_speculative(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: dict) -> Method:
    if plan is None:
        raise SelfSpecError("method self_speculative needs a skip plan: set plan=<file> "
                            "(python -m selfspec.search writes results/plans/<model>-<dataset>.json)")
    options = DraftOptions(**opts)
    path = DraftPath(lm.model, plan, options, stop_ids=lm.eos_ids)
    return Method("self_speculative",
                  lambda ids, c: self_speculative(lm.model, ids, plan, c, lm.eos_ids, draft=path), cfg, plan,
                  extra_memory_bytes=path.extra_bytes + _packed_bytes(lm, cfg), info=options.record())


OUR_METHODS = ("autoregressive", "self_speculative")

BUILDERS: dict[str, Callable[[LoadedModel, DecodeConfig, SkipPlan | None, dict], Method]] = {
    "autoregressive": _autoregressive,
    "self_speculative": _self_speculative,
}


def build_method(name: str, lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None = None,
                 options: dict | None = None) -> Method:
    """Build method ``name``; ``options`` are the method's own settings (``conf/method``)."""
    from . import baselines  # noqa: F401  (registers the transformers baselines)

    if name not in BUILDERS:
        raise SelfSpecError(f"unknown method {name!r}; choose from {', '.join(BUILDERS)}")
    if cfg.packed_only and name not in OUR_METHODS:
        raise SelfSpecError(f"method {name} runs the model as loaded, but packed_only frees its dense weights; "
                            "run it in a separate run without decoding.packed_only")
    return BUILDERS[name](lm, cfg, plan, dict(options or {}))
