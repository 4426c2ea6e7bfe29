"""What users would pick instead: transformers' own decoding, in our harness.

- ``hf_generate``: ``model.generate`` greedy (plain autoregressive);
- ``hf_prompt_lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens``);
- ``hf_assisted``: assisted generation with a second, smaller model of the same
  tokenizer drafting (``assistant_model``);
- ``hf_early_exit``: LayerSkip-style self-drafting from the first layers
  (``assistant_early_exit``).

Each is timed with the same :class:`~selfspec.stats.Clock` as our methods; a
streamer stamps the time each new token becomes available (time to first
token, per-token latencies); new tokens are counted as ours are (EOS
included, at most ``max_new_tokens``).
"""

from __future__ import annotations

import torch

from .decoding import DecodeConfig, Generation
from .errors import SelfSpecError
from .methods import BUILDERS, Method
from .models import LoadedModel, load_model
from .plan import SkipPlan
from .stats import Clock, DecodeStats


class _Stamps:
    """A generate() streamer recording (time, number of new tokens) per push."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.pushes: list[tuple[float, int]] = []
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() pushes the prompt first
            self.prompt_seen = True
            return
        self.pushes.append((self.clock.now(), int(value.numel())))

    def end(self) -> None:
        pass


def _hf_run(lm: LoadedModel, name: str, gen_kwargs: dict):
    model = lm.model
    device = next(model.parameters()).device
    clock = Clock(device)
    eos = sorted(lm.eos_ids)
    pad = getattr(lm.tokenizer, "pad_token_id", None)
    pad = eos[0] if pad is None else pad

    def run(ids: list[int], cfg: DecodeConfig) -> Generation:
        if not cfg.sampling.greedy:
            raise SelfSpecError(f"{name} is run greedy only in this harness")
        stats = DecodeStats(method=name, prompt_tokens=len(ids))
        if cfg.max_new_tokens == 0:
            return Generation([], stats)
        x = torch.tensor([ids], dtype=torch.long, device=device)
        stamps = _Stamps(clock)
        t0 = clock.now()
        with torch.inference_mode():
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                do_sample=False, temperature=None, top_p=None, top_k=None, eos_token_id=eos,
                pad_token_id=pad, streamer=stamps, **gen_kwargs,
            )
        t1 = clock.now()
        new = out[0, len(ids):].tolist()[: cfg.max_new_tokens]
        for i, t in enumerate(new):
            if t in lm.eos_ids:
                new = new[: i + 1]
                stats.stop_reason = "eos"
                break
        else:
            stats.stop_reason = "max_new_tokens"
        stats.total_time = t1 - t0
        prev = t0
        for t, n in stamps.pushes:
            n = min(n, len(new) - len(stats.token_latencies))
            if n <= 0:
                break
            if not stats.token_latencies:
                stats.ttft = stats.prefill_time = t - t0
            stats.token_latencies.extend([(t - prev) / n] * n)
            prev = t
        stats.new_tokens = len(new)
        return Generation(new, stats)

    return run


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _hf_generate(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: dict) -> Method:
    return Method("hf_generate", _hf_run(lm, "hf_generate", {}), cfg)


def _hf_prompt_lookup(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: dict) -> Method:
    n = int(opts.get("num_tokens", 10))
    kw = {"prompt_lookup_num_tokens": n, "max_matching_ngram_size": int(opts.get("max_ngram", 2))}
    return Method("hf_prompt_lookup", _hf_run(lm, "hf_prompt_lookup", kw), cfg, info={"num_tokens": n})


def _hf_assisted(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: dict) -> Method:
    name = opts.get("assistant")
    if not name:
        raise SelfSpecError("hf_assisted needs an assistant model: set method_options.hf_assisted.assistant")
    dtype = next(lm.model.parameters()).dtype
    device = str(next(lm.model.parameters()).device)
    draft = load_model(name, dtype=dtype, device=device, cache_dir=opts.get("cache_dir"))
    if draft.tokenizer.get_vocab() != lm.tokenizer.get_vocab():
        raise SelfSpecError(f"assistant {name!r} has another tokenizer than {lm.name!r}")
    kw = {"assistant_model": draft.model}
    return Method("hf_assisted", _hf_run(lm, "hf_assisted", kw), cfg,
                  extra_memory_bytes=_param_bytes(draft.model), info={"assistant": name})


def _hf_early_exit(lm: LoadedModel, cfg: DecodeConfig, plan: SkipPlan | None, opts: dict) -> Method:
    layer = opts.get("exit_layer")
    if layer is None:
        raise SelfSpecError("hf_early_exit needs method_options.hf_early_exit.exit_layer")
    return Method("hf_early_exit", _hf_run(lm, "hf_early_exit", {"assistant_early_exit": int(layer)}), cfg,
                  info={"exit_layer": int(layer)})


BUILDERS.update({
    "hf_generate": _hf_generate,
    "hf_prompt_lookup": _hf_prompt_lookup,
    "hf_assisted": _hf_assisted,
    "hf_early_exit": _hf_early_exit,
})
