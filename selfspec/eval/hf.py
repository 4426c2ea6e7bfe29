"""What users would pick instead: transformers' own decoding, timed and counted as ours.

- ``hf_generate``: ``model.generate`` (plain autoregressive);
- ``hf_prompt_lookup``: prompt-lookup decoding (``prompt_lookup_num_tokens``);
- ``hf_assisted``: assisted generation with a second, smaller model of the same
  tokenizer drafting (``assistant_model``);
- ``hf_early_exit``: LayerSkip-style self-drafting from the first layers
  (``assistant_early_exit``).

Each is timed with the same :class:`~selfspec.stats.Clock` as our methods; a
streamer stamps the time each new token becomes available (time to first
token, per-token latencies); new tokens are counted as ours are (EOS
included, at most ``max_new_tokens``). Greedy, or sampling with the run's temperature, top-k and top-p:
transformers then verifies prompt lookup's guesses against a token it samples, and an assistant's
(or early exit's) drafts by speculative sampling.

Kernels: with ``packed=True`` the call runs inside :func:`~selfspec.kernels.packed.packed_weights`
for the model (and an assistant model), so its linears run on the same prepacked
oneDNN kernels as our methods; with ``packed=False`` on transformers' stock kernels.
Either way the model attends as the run's ``attention`` says, as our methods do.
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from selfspec.assets.models import LoadedModel
from selfspec.engine.attention import decode_attention
from selfspec.engine.decoding import DecodeConfig, Generation
from selfspec.engine.stats import Clock, DecodeStats
from selfspec.kernels.packed import packed_weights


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


def hf_runner(lm: LoadedModel, name: str, gen_kwargs: dict, packed: bool = False, also_packed=()):
    """A ``run(ids, cfg) -> Generation`` that calls ``lm.model.generate`` with ``gen_kwargs``: greedy, or
    sampling with the run's temperature, top-k and top-p (seeded with ``cfg.seed`` on each call).

    ``packed``: on the prepacked weights of ``lm.model`` and of the models in ``also_packed``.
    """
    model = lm.model
    device = next(model.parameters()).device
    clock = Clock(device)
    eos = sorted(lm.eos_ids)
    pad = getattr(lm.tokenizer, "pad_token_id", None)
    pad = eos[0] if pad is None else pad

    def run(ids: list[int], cfg: DecodeConfig) -> Generation:
        sp = cfg.sampling
        if sp.greedy:
            sampling = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        else:  # transformers' samplers, on the filters ours has (top_k 0 and top_p 1 are off in both)
            sampling = {"do_sample": True, "temperature": sp.temperature, "top_p": sp.top_p, "top_k": sp.top_k}
            torch.manual_seed(cfg.seed)  # generate() draws from torch's global generator
        stats = DecodeStats(method=name, prompt_tokens=len(ids))
        if cfg.max_new_tokens == 0:
            return Generation([], stats)
        x = torch.tensor([ids], dtype=torch.long, device=device)
        stamps = _Stamps(clock)
        t0 = clock.now()
        with torch.inference_mode(), ExitStack() as kernels:
            for m in (model, *also_packed) if packed else ():
                kernels.enter_context(packed_weights(m))
            for m in (model, *also_packed):  # the run's attention, on stock kernels too
                kernels.enter_context(decode_attention(m, cfg.attention == "decode", cfg.row_invariant))
            out = model.generate(
                input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=cfg.max_new_tokens,
                eos_token_id=eos, pad_token_id=pad, streamer=stamps, **sampling, **gen_kwargs,
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
