"""Autoregressive and self-speculative decoding on one model and one cache.

Both methods run through the same :class:`Request`: the same forward call
(:meth:`Request.forward`, which seeks the cache and passes absolute positions
explicitly), the same token bookkeeping and the same :class:`Clock`. The
autoregressive baseline is the loop of plain steps; self-speculative decoding
replaces plain steps by rounds of ``draft k tokens with the plan's sublayers
skipped -> verify k+1 positions in one full-depth forward``.

Invariants:
- the loop owns positions: ``self.pos`` is the absolute position of the
  pending token (emitted, not yet run through the full model); every slot
  below ``pos`` holds full-model keys/values in every layer;
- rejected drafts are rolled back by not advancing ``pos`` past them (the
  cache is never copied or cropped);
- greedy self-speculative output is token-identical to greedy
  autoregressive output (up to floating-point differences between a
  one-token and a multi-token forward); sampling keeps the target
  distribution (see :mod:`selfspec.engine.sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.draft.fused import draft_step
from selfspec.draft.path import DEFAULT_ADAPTIVE, DEFAULT_K, DEFAULT_K_MAX, DEFAULT_THRESHOLD, DEFAULT_THRESHOLD_STEP
from selfspec.engine.attention import ATTENTION, REAL_ROWS, ROW_INVARIANT, decode_attention
from selfspec.engine.cache import PositionalKVCache, cache_kwargs
from selfspec.engine.sampling import (
    SamplingParams,
    greedy_ids,
    probs_from_logits,
    sample,
)
from selfspec.engine.stats import Clock, DecodeStats
from selfspec.errors import SelfSpecError
from selfspec.kernels.packed import default_rows, packed_weights


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode. ``k`` is the (maximum) number of drafted tokens per round.

    Growing drafts (``k_max`` > ``k``): a model draft one token longer after each model-drafted round
    that drafted its full length and had every draft accepted, up to ``k_max``; ``k`` again after any other model
    round. Copies keep ``k``'s limits. The rule sees only past rounds, so outputs are unchanged.

    Adaptive draft exit (Draft & Verify): drafting stops after a token whose
    draft probability is below ``threshold``; after each round the threshold
    moves up by ``threshold_step`` when the running acceptance is under
    ``target_acceptance`` and down otherwise (``threshold_step`` 0: a fixed threshold).

    ``packed_weights``: run the model's bf16 linears on copies prepacked for
    oneDNN (:mod:`selfspec.kernels.packed`; same tokens, faster steps, the copies'
    memory extra); ignored where nothing can be packed. ``packed_only``: free
    the dense weights once packed, so packing adds no memory; the model then
    computes on the packed weights outside our loop too (same results), so
    transformers' methods cannot serve as a stock baseline in that process.

    ``rows``: every full-model forward of our loop over fewer tokens (a plain step, a short
    verify) is padded to this many rows (:func:`forward_at`): same tokens, and on CPU kernels
    that read the weights faster over a few rows than over one, faster steps. The default is
    the CPU's (:func:`~selfspec.kernels.packed.default_rows`): 6 where bf16 weights are packed,
    1 where extra rows cost (AVX2 CPUs). Draft steps stay
    one row (the int8/int4 draft kernels cost more per row).

    ``row_invariant`` (with ``attention="decode"``): every full-model forward computes each row as an AR
    step at its position would (:mod:`selfspec.engine.attention`, docs/numerics.md), so greedy output equals
    greedy AR output token for token in bf16 where the CPU's linear kernels are row-invariant too; false
    reduces the attention over the keys as they come in matrix products, which rounds a row differently by the
    forward's width (kept for measuring; not faster where the C++ row kernel serves bf16 rows).

    ``attention``: ``decode`` (default) attends through :mod:`selfspec.engine.attention` in every
    forward of a few rows (the row kernel for bf16, else batched products; torch's CPU SDPA runs its flash
    kernel even for one row, 6x slower at 1000 keys), ``sdpa`` as the model was loaded. Every
    method of a run attends alike (the transformers ones too: :mod:`selfspec.eval.hf`).

    Gate (``gate``): a round with no copy match drafts with the model only while model-drafted
    rounds measure at least as fast as plain steps (running tokens per second of each, from
    ``fallback_min_rounds`` model rounds on); otherwise it takes a plain step, and every
    ``gate_probe`` such steps one model round is drafted again to refresh its rate. Copy rounds
    always run. Which kind of round runs depends only on past timings, never on the tokens to
    come, so greedy output and the sampling distribution are unchanged.

    Fallback: after ``fallback_min_rounds`` rounds, when the running
    tokens-per-round times the verify time falls under the running round
    time (speculation predicted slower than plain decoding), the request
    continues with plain steps and the stats record where.
    """

    max_new_tokens: int = 128
    k: int = DEFAULT_K
    adaptive: bool = DEFAULT_ADAPTIVE
    threshold: float = DEFAULT_THRESHOLD
    k_max: int = DEFAULT_K_MAX
    threshold_step: float = DEFAULT_THRESHOLD_STEP
    target_acceptance: float = 0.7
    fallback: bool = True
    fallback_min_rounds: int = 8
    gate: bool = False
    gate_probe: int = 8
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    packed_weights: bool = True
    packed_only: bool = False
    rows: int = field(default_factory=default_rows)  # 6 where bf16 weights are packed, else 1 (no padding)
    attention: str = "decode"
    row_invariant: bool = ROW_INVARIANT

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise SelfSpecError(f"k (draft tokens per round) must be an integer >= 1, got {self.k!r}")
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 0:
            raise SelfSpecError(f"k_max (the longest a growing model draft gets) must be an integer >= 0, "
                                f"got {self.k_max!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise SelfSpecError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not 0.0 <= self.threshold < 1.0:
            raise SelfSpecError(f"threshold must be in [0, 1), got {self.threshold}")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or not 1 <= self.rows <= 64:
            raise SelfSpecError(f"rows (padded forward width) must be an integer in 1..64, got {self.rows!r}")
        if isinstance(self.gate_probe, bool) or not isinstance(self.gate_probe, int) or self.gate_probe < 1:
            raise SelfSpecError(f"gate_probe (plain steps between model-draft probes) must be an integer >= 1, "
                                f"got {self.gate_probe!r}")
        if self.attention not in ATTENTION:
            raise SelfSpecError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.packed_only and not self.packed_weights:
            raise SelfSpecError("packed_only frees the dense weights of packed ones: it needs packed_weights=true")

    @property
    def longest_draft(self) -> int:
        """The most tokens one model draft makes: ``k``, or ``k_max`` for a draft that grows past it."""
        return max(self.k, self.k_max)


@dataclass
class Generation:
    """New token ids (EOS included when it ended the request), the raw stats, and where each token came from
    (:data:`SOURCES`; empty where a method does not say)."""

    tokens: list[int]
    stats: DecodeStats
    sources: list[str] = field(default_factory=list)


SOURCES = {"step": "a full-model step (the prefill's token, a plain step)",
           "copy": "copied from the context and accepted by the verify pass",
           "draft": "drafted by the cheap model and accepted by the verify pass",
           "verify": "the verify pass's own token: the correction of the first rejected draft, or the bonus token"}


def forward_at(model, cache: PositionalKVCache, tokens: torch.Tensor, start: int, keep: int,
               positions: torch.Tensor | None = None, *, position_ids: torch.Tensor | None = None,
               attention_mask=None, rows: int = 1) -> torch.Tensor:
    """The one forward everything uses: ``tokens`` at absolute positions ``start..`` on ``cache``.

    Seeks the cache, passes the positions explicitly, and returns the logits
    ``[keep, V]`` of the last ``keep`` tokens. ``positions`` is an optional
    preallocated ``[1, >= start+n]`` row of position ids to slice from. A draft tree's
    verify passes its own ``position_ids`` (by depth) and ``attention_mask``
    (:func:`selfspec.engine.tree.tree_attention_mask`); the tokens still fill slots ``start..``.

    ``rows``: a forward over fewer tokens is padded to this many rows (copies of the last
    token at the next positions, after the real ones, so the causal mask hides them from the
    real rows; their cache slots are overwritten before any forward reads them; where the row
    kernel serves the attention they attend one key, so their cost does not grow with the context). On CPU a
    matrix product over a few rows can read the weights faster than over one
    (``scripts/verify_width.py``). The cache must hold ``rows - n`` slots past the tokens.
    """
    n = tokens.shape[-1]
    pad = rows - n if position_ids is None and attention_mask is None else 0
    if pad > 0:
        tokens = torch.cat([tokens.reshape(-1), tokens.reshape(-1)[-1:].expand(pad)])
    width = n + max(pad, 0)
    cache.seek(start, width, causal=position_ids is None and attention_mask is None)
    if position_ids is not None:
        pos = position_ids.reshape(1, n)
    elif positions is None:
        pos = torch.arange(start, start + width, device=tokens.device)[None]
    else:
        pos = positions[:, start : start + width]
    step = draft_step(model) if attention_mask is None and position_ids is None and pad <= 0 else None
    if step is not None:  # a draft forward whose kept sublayers all run fused (selfspec.draft.fused.FusedStep)
        logits = step(tokens, start, cache, keep)
        if logits is not None:
            return logits
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    if pad > 0:  # the padding rows' keys: their first only, on the row kernel (selfspec.engine.attention)
        kwargs[REAL_ROWS] = n
    out = model(input_ids=tokens.reshape(1, width), position_ids=pos, **cache_kwargs(model, cache),
                use_cache=True, logits_to_keep=keep + max(pad, 0), **kwargs)
    return out.logits[0, :keep]


def context_length(model) -> int | None:
    cfg = model.config.get_text_config(decoder=True)
    return getattr(cfg, "max_position_embeddings", None)


class Request:
    """State of one generation request: cache, positions, tokens, stats (both loops drive one; tests may too)."""

    def __init__(self, model, prompt_ids, cfg: DecodeConfig, eos_ids, method: str, extra_slots: int) -> None:
        ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise SelfSpecError("the prompt is empty: give at least one token")
        n_ctx = context_length(model)
        need = ids.numel() + cfg.max_new_tokens
        if n_ctx is not None and need > n_ctx:
            raise SelfSpecError(
                f"the prompt has {ids.numel()} tokens; with max_new_tokens={cfg.max_new_tokens} that is "
                f"{need} positions, more than the model's context of {n_ctx}"
            )
        self.model = model
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.prompt = ids.to(self.device)
        self.eos = frozenset(int(e) for e in eos_ids)
        self.cache = PositionalKVCache(model, max_len=need + extra_slots + cfg.rows)
        self.positions = torch.arange(self.cache.max_len, device=self.device).unsqueeze(0)
        self.clock = Clock(self.device)
        self.stats = DecodeStats(method=method, prompt_tokens=ids.numel())
        self.generator = None
        if not cfg.sampling.greedy:
            self.generator = torch.Generator(device=self.device).manual_seed(cfg.seed)
        self.out: list[int] = []
        self.sources: list[str] = []  # one SOURCES key per token of out
        self.pos = 0
        self.pending = -1
        self.done = cfg.max_new_tokens == 0
        self.t_start = 0.0

    # -- the one forward both methods use ------------------------------------------
    def forward(self, tokens: torch.Tensor, start: int, keep: int, rows: int | None = None) -> torch.Tensor:
        """Logits ``[keep, V]`` for the last ``keep`` of ``tokens`` placed at ``start..``
        (padded to ``rows``, by default the config's: see :class:`DecodeConfig`)."""
        return forward_at(self.model, self.cache, tokens, start, keep, self.positions,
                          rows=self.cfg.rows if rows is None else rows)

    def pick(self, logits: torch.Tensor) -> int:
        """The target's choice from one row of logits (argmax or a sample of p)."""
        if self.cfg.sampling.greedy:
            return int(greedy_ids(logits))
        return int(sample(probs_from_logits(logits, self.cfg.sampling), self.generator))

    # -- bookkeeping shared by both methods ------------------------------------------
    def emit(self, tokens: list[int], sources: list[str]) -> list[int]:
        """Append tokens (each from the matching :data:`SOURCES` key), stopping at EOS and at max_new_tokens;
        returns what was kept."""
        room = self.cfg.max_new_tokens - len(self.out)
        kept = tokens[:room]
        for i, t in enumerate(kept):
            if t in self.eos:
                kept = kept[: i + 1]
                self.stats.stop_reason = "eos"
                self.done = True
                break
        self.out.extend(kept)
        self.sources.extend(sources[: len(kept)])
        if len(self.out) >= self.cfg.max_new_tokens and not self.done:
            self.stats.stop_reason = "max_new_tokens"
            self.done = True
        return kept

    def start(self) -> None:
        """Prefill the prompt and emit the first token (time to first token)."""
        self.t_start = self.clock.now()
        if self.done:
            self.stats.stop_reason = "max_new_tokens"
            return
        logits = self.forward(self.prompt, 0, keep=1)
        first = self.pick(logits[-1])
        self.pos = self.prompt.numel()
        self.pending = first
        self.emit([first], ["step"])
        self.stats.ttft = self.stats.prefill_time = self.clock.now() - self.t_start
        self.stats.new_tokens = 1

    def plain_step(self) -> None:
        """One full-depth forward of the pending token; emits the next token."""
        t0 = self.clock.now()
        logits = self.forward(self.token_tensor([self.pending]), self.pos, keep=1)
        nxt = self.pick(logits[-1])
        self.pos += 1
        self.pending = nxt
        kept = self.emit([nxt], ["step"])
        dt = self.clock.now() - t0
        self.stats.plain_steps += 1
        self.stats.step_time += dt
        self.stats.record_tokens(len(kept), dt)

    def token_tensor(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def finish(self) -> Generation:
        self.stats.total_time = self.clock.now() - self.t_start
        return Generation(tokens=list(self.out), stats=self.stats, sources=list(self.sources))


def autoregressive(model, prompt_ids, cfg: DecodeConfig, eos_ids=()) -> Generation:
    """Plain decoding: one full-depth forward per new token."""
    run = Request(model, prompt_ids, cfg, eos_ids, "autoregressive", extra_slots=1)
    with torch.inference_mode(), packed_weights(model, cfg.packed_weights, cfg.packed_only), \
            decode_attention(model, cfg.attention == "decode", cfg.row_invariant):
        run.start()
        while not run.done:
            run.plain_step()
    return run.finish()
