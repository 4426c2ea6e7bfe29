"""Every decoding method the runner can compare, behind one interface and listed in one place.

A :class:`Method` turns prompt ids into a :class:`~selfspec.engine.decoding.Generation`
(new tokens and :class:`~selfspec.engine.stats.DecodeStats`). Our own
``autoregressive`` and ``self_speculative`` share one forward, one token count
and one clock (:mod:`selfspec.engine.decoding`); the transformers baselines
(:mod:`selfspec.eval.hf`) are timed with the same :class:`~selfspec.engine.stats.Clock`
and count new tokens the same way (EOS included, cut at ``max_new_tokens``).
:data:`BUILDERS` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from selfspec.assets.models import LoadedModel, load_model
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.decoding import DecodeConfig, Generation, autoregressive
from selfspec.engine.speculate import self_speculative
from selfspec.errors import SelfSpecError
from selfspec.eval.hf import hf_runner
from selfspec.kernels.packed import kernels_label, weight_packer
from selfspec.model.plan import SkipPlan
from selfspec.typed import typed


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


@dataclass(frozen=True)
class PromptLookupOptions:
    num_tokens: int = 10  # prompt_lookup_num_tokens
    max_ngram: int = 2  # max_matching_ngram_size


# transformers' schedules of the number of drafted tokens that start each generate() call afresh
# ("heuristic" carries its count from one prompt to the next, so a prompt's speed would depend on the ones before)
SCHEDULES = ("constant", "heuristic_transient")


@dataclass(frozen=True)
class DraftLengthOptions:
    """How many tokens a transformers drafter proposes per round (its defaults are transformers' own)."""

    num_tokens: int = 20  # num_assistant_tokens: the most tokens drafted per round
    schedule: str = "constant"  # num_assistant_tokens_schedule: constant | heuristic_transient (+2 / -1 per round)
    confidence: float = 0.4  # assistant_confidence_threshold: stop drafting below this probability (0: never)

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise SelfSpecError(f"num_tokens must be at least 1, got {self.num_tokens}")
        if self.schedule not in SCHEDULES:
            raise SelfSpecError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r} "
                                "(\"heuristic\" carries its draft length from one prompt to the next)")
        if not 0.0 <= self.confidence < 1.0:
            raise SelfSpecError(f"confidence must be in [0, 1), got {self.confidence}")

    def generation_settings(self) -> dict:
        return {"num_assistant_tokens": self.num_tokens, "num_assistant_tokens_schedule": self.schedule,
                "assistant_confidence_threshold": self.confidence}

    def record(self) -> dict:
        return {"num_tokens": self.num_tokens, "schedule": self.schedule, "confidence": self.confidence}


@dataclass(frozen=True)
class AssistedOptions(DraftLengthOptions):
    assistant: str = "qwen2.5-coder-0.5b"  # the draft model (same tokenizer as the target)
    cache_dir: str | None = None


@dataclass(frozen=True)
class EarlyExitOptions(DraftLengthOptions):
    exit_layer: int = 8  # assistant_early_exit


def _packed_bytes(lm: LoadedModel, cfg: DecodeConfig) -> int:
    """Packs the weights now (not inside a timed request) and returns the copies' size.

    With ``packed_only`` the dense weights are freed now and only the packed
    copies of weights that must stay dense count (the LM head's, tied ones).
    """
    return weight_packer(lm.model, not cfg.packed_only).extra_bytes if cfg.packed_weights else 0


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _autoregressive(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: None) -> Method:
    return Method("autoregressive", lambda ids, c: autoregressive(lm.model, ids, c, lm.eos_ids), cfg,
                  extra_memory_bytes=_packed_bytes(lm, cfg))


def _self_speculative(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, options: DraftOptions) -> Method:
    if plan is None:
        raise SelfSpecError("method self_speculative needs a skip plan: set plan=<file> "
                            "(python -m selfspec.search writes results/plans/<model>-<dataset>.json)")
    path = DraftPath(lm.model, plan, options, stop_ids=lm.eos_ids)
    return Method("self_speculative",
                  lambda ids, c: self_speculative(lm.model, ids, plan, c, lm.eos_ids, draft=path), cfg, plan,
                  extra_memory_bytes=path.extra_bytes + _packed_bytes(lm, cfg), info=_draft_info(options, path))


def _draft_info(options: DraftOptions, path: DraftPath) -> dict | None:
    """What a run records of a draft: its options, and ``draft_kernel`` where it drafts on our VNNI int4 kernel
    (runs on torch's kernels record none, as before it existed): ``int4-vnni``, or ``fused int4-vnni`` where its
    kept sublayers run as one call each (:mod:`selfspec.draft.fused`; ``draft_fused``: how many)."""
    info = options.record()
    if "int4-vnni" in path.kernels:
        info = {**(info or {}), "draft_kernel": "fused int4-vnni" if path.fused else "int4-vnni"}
        if path.fused:
            info["draft_fused"] = len(path.fused)
    return info


def _hf(name: str, lm: LoadedModel, cfg: DecodeConfig, kwargs: dict, stock: bool, info: dict | None = None,
        assistant=None, drafter=None, length: DraftLengthOptions | None = None) -> Method:
    """A transformers method on our kernels (the prepacked weights, when ``cfg.packed_weights``) or stock ones.

    ``drafter``: the model whose ``generation_config`` transformers reads the draft length from (the
    assistant, or the model itself for early exit); ``length`` is set on it for each call and put back after.
    """
    packed = cfg.packed_weights and not stock
    extra = _param_bytes(assistant) if assistant is not None else 0
    if packed:  # pack now, not inside a timed request
        extra += _packed_bytes(lm, cfg) + (weight_packer(assistant).extra_bytes if assistant is not None else 0)
    full = f"{name}_stock" if stock else name
    run = hf_runner(lm, full, kwargs, packed=packed, also_packed=(assistant,) if assistant is not None else ())
    if length is not None:
        run = _with_generation_settings(run, drafter.generation_config, length.generation_settings())
        info = {**(info or {}), **length.record()}
    return Method(full, run, cfg, extra_memory_bytes=extra,
                  info={**(info or {}), "kernels": kernels_label(packed)})


def _with_generation_settings(run, config, settings: dict):
    """``run`` with ``settings`` on generation config ``config`` during each call (a model's config is shared
    by every method of a run that uses the model, so each sets its own and puts the old values back)."""
    def wrapped(ids: list[int], cfg: DecodeConfig) -> Generation:
        old = {k: getattr(config, k, None) for k in settings}
        for k, v in settings.items():
            setattr(config, k, v)
        try:
            return run(ids, cfg)
        finally:
            for k, v in old.items():
                setattr(config, k, v)
    return wrapped


def _hf_generate(stock: bool):
    def build(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: None) -> Method:
        return _hf("hf_generate", lm, cfg, {}, stock)
    return build


def _hf_prompt_lookup(stock: bool):
    def build(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: PromptLookupOptions) -> Method:
        kw = {"prompt_lookup_num_tokens": opts.num_tokens, "max_matching_ngram_size": opts.max_ngram}
        return _hf("hf_prompt_lookup", lm, cfg, kw, stock, {"num_tokens": opts.num_tokens, "max_ngram": opts.max_ngram})
    return build


def _hf_assisted(stock: bool):
    def build(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: AssistedOptions) -> Method:
        name = opts.assistant
        if not name:
            raise SelfSpecError("hf_assisted needs an assistant model: set method_options.hf_assisted.assistant")
        dtype = next(lm.model.parameters()).dtype
        device = str(next(lm.model.parameters()).device)
        draft = load_model(name, dtype=dtype, device=device, cache_dir=opts.cache_dir)
        if draft.tokenizer.get_vocab() != lm.tokenizer.get_vocab():
            raise SelfSpecError(f"assistant {name!r} has another tokenizer than {lm.name!r}")
        return _hf("hf_assisted", lm, cfg, {"assistant_model": draft.model}, stock, {"assistant": name},
                   assistant=draft.model, drafter=draft.model, length=opts)
    return build


def _hf_early_exit(stock: bool):
    def build(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: EarlyExitOptions) -> Method:
        layer = int(opts.exit_layer)
        if not 0 < layer < lm.num_layers:
            raise SelfSpecError(f"exit_layer must be in 1..{lm.num_layers - 1} for {lm.name}, got {layer}")
        return _hf("hf_early_exit", lm, cfg, {"assistant_early_exit": layer}, stock, {"exit_layer": layer},
                   drafter=lm.model, length=opts)
    return build


OUR_METHODS = ("autoregressive", "self_speculative")
_TRANSFORMERS = {"hf_generate": _hf_generate, "hf_prompt_lookup": _hf_prompt_lookup, "hf_assisted": _hf_assisted,
                 "hf_early_exit": _hf_early_exit}

BUILDERS: dict[str, Callable[[LoadedModel, DecodeConfig, SkipPlan | None, Any], Method]] = {
    "autoregressive": _autoregressive,
    "self_speculative": _self_speculative,
    # transformers' methods on our kernels (the prepacked weights), and each on its stock kernels
    **{name: make(stock=False) for name, make in _TRANSFORMERS.items()},
    **{f"{name}_stock": make(stock=True) for name, make in _TRANSFORMERS.items()},
}
OPTIONS: dict[str, type] = {  # each method's own settings (method_options.<name>), defaults held here
    "self_speculative": DraftOptions,
    "hf_prompt_lookup": PromptLookupOptions,
    "hf_assisted": AssistedOptions,
    "hf_early_exit": EarlyExitOptions,
}


def split_variant(name: str) -> tuple[str, str]:
    """``self_speculative-tree`` -> (``self_speculative``, ``tree``): a method may run several times in one run,
    each variant under its own name with its own ``method_options.<name>`` on top of the method's."""
    base, _, label = name.partition("-")
    return base, label


# decoding settings a method (variant) may set for itself (method_options.<name>.decoding): how our loop
# pads its forwards and reduces its attention, the draft's length policy and the model-draft gate; the rest
# (max_new_tokens, sampling, ...) a run shares
PER_METHOD_DECODING = ("rows", "row_invariant", "k", "adaptive", "threshold", "threshold_step", "k_max", "gate",
                       "gate_probe")


def options_key(name: str) -> str:
    """The ``method_options`` key of a method: a stock variant takes its method's options."""
    return split_variant(name)[0].removesuffix("_stock")


def method_options(name: str, options: dict) -> dict | None:
    """A method's own settings from ``method_options``: its method's, then its variant's on top."""
    base = options.get(options_key(name))
    if not split_variant(name)[1]:
        return base
    return {**(base or {}), **(options.get(name) or {})}


def build_method(name: str, lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None = None,
                 options: Any = None, decoding: dict | None = None) -> Method:
    """Build method ``name`` (or its variant ``name-label``); ``options`` are its own settings: the typed
    :data:`OPTIONS` of its method, or a mapping of them (:func:`method_options`; a ``decoding`` key in it is
    ``decoding``), and ``decoding`` the decoding settings it sets for itself (:data:`PER_METHOD_DECODING`)."""
    base, label = split_variant(name)
    if base not in BUILDERS or ("-" in name and not label.replace("_", "").isalnum()):
        raise SelfSpecError(f"unknown method {name!r}; choose from {', '.join(BUILDERS)} "
                            "(a variant: <method>-<label>, label of letters, digits and _)")
    if plan is not None:
        plan.check_model(lm.num_layers, lm.name)
    device = next(lm.model.parameters()).device
    if cfg.packed_weights and not base.endswith("_stock") and device.type != "cpu":
        raise SelfSpecError(f"decoding.packed_weights uses CPU (oneDNN) kernels and the model is on {device}; "
                            "set decoding.packed_weights=false there")
    if cfg.packed_only and base not in OUR_METHODS:
        raise SelfSpecError(f"method {name} runs the model as loaded, but packed_only frees its dense weights; "
                            "run it in a separate run without decoding.packed_only")
    key = options_key(name)
    if isinstance(options, dict) or options is None:
        options = dict(options or {})
        decoding = {**(options.pop("decoding", None) or {}), **(decoding or {})}
    elif not isinstance(options, OPTIONS.get(key, ())):
        raise SelfSpecError(f"method {name} takes {OPTIONS[key].__name__ if key in OPTIONS else 'no options'}, "
                            f"got {type(options).__name__}")
    if decoding:
        unknown = sorted(set(decoding) - set(PER_METHOD_DECODING))
        if unknown:
            raise SelfSpecError(f"method_options.{name}.decoding may set {', '.join(PER_METHOD_DECODING)}; "
                                f"got {', '.join(unknown)} (the others are shared by every method of a run)")
        if base not in OUR_METHODS:
            raise SelfSpecError(f"method_options.{name}.decoding applies to our own loop, not to {base}")
        fields = {**asdict(cfg), **decoding}
        cfg = typed(DecodeConfig, {**fields, "sampling": asdict(cfg.sampling)}, f"method_options.{name}.decoding")
    if key in OPTIONS:
        opts = options if isinstance(options, OPTIONS[key]) else typed(OPTIONS[key], options, f"method_options.{key}")
    elif options:
        raise SelfSpecError(f"method {name} takes no options, got method_options.{key}={options}")
    else:
        opts = None
    method = BUILDERS[base](lm, cfg, plan, opts)
    method.name = name
    return method
