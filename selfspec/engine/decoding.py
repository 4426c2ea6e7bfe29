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

from selfspec.draft.copy import NGramIndex
from selfspec.draft.fused import draft_step
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.attention import ATTENTION, decode_attention
from selfspec.engine.cache import PositionalKVCache, cache_kwargs
from selfspec.engine.masks import causal_mask
from selfspec.engine.sampling import (
    SamplingParams,
    probs_from_logits,
    sample,
    verify_greedy,
    verify_sampling,
)
from selfspec.engine.stats import Clock, DecodeStats
from selfspec.engine.tree import DraftTree, tree_attention_mask
from selfspec.errors import SelfSpecError
from selfspec.kernels.packed import default_rows, packed_weights
from selfspec.model.plan import SkipPlan


@dataclass(frozen=True)
class DecodeConfig:
    """How to decode. ``k`` is the (maximum) number of drafted tokens per round.

    Adaptive draft exit (Draft & Verify): drafting stops after a token whose
    draft probability is below ``threshold``; after each round the threshold
    moves up by ``threshold_step`` when the running acceptance is under
    ``target_acceptance`` and down otherwise.

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

    ``exact``: greedy self-speculative output token-identical to greedy autoregressive output
    in bf16 too. Every full-model forward then has ``rows`` rows and attends over the same
    number of keys (the whole preallocated cache, masked), so a token's row goes through the
    same kernels with the same reductions in an AR step and in a verify pass. ``rows`` must
    cover the longest verify (k+1, copy_tokens+1); the AR baseline must run with the same
    ``rows`` and ``exact``. Chains only: draft trees are refused.

    ``attention``: ``decode`` (default) attends through :mod:`selfspec.engine.attention` in every
    forward of a few rows (two batched products over the cache; torch's CPU SDPA runs its flash
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
    k: int = 4
    adaptive: bool = False
    threshold: float = 0.5
    threshold_step: float = 0.05
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
    exact: bool = False
    attention: str = "decode"

    def __post_init__(self) -> None:
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise SelfSpecError(f"k (draft tokens per round) must be an integer >= 1, got {self.k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise SelfSpecError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not 0.0 <= self.threshold < 1.0:
            raise SelfSpecError(f"threshold must be in [0, 1), got {self.threshold}")
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or not 1 <= self.rows <= 64:
            raise SelfSpecError(f"rows (padded forward width) must be an integer in 1..64, got {self.rows!r}")
        if self.exact and self.rows < 2:
            raise SelfSpecError("exact greedy pads every full-model forward to `rows` rows: set rows to the longest "
                                "verify (k+1, or copy_tokens+1 with copy drafting)")
        if isinstance(self.gate_probe, bool) or not isinstance(self.gate_probe, int) or self.gate_probe < 1:
            raise SelfSpecError(f"gate_probe (plain steps between model-draft probes) must be an integer >= 1, "
                                f"got {self.gate_probe!r}")
        if self.attention not in ATTENTION:
            raise SelfSpecError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if self.packed_only and not self.packed_weights:
            raise SelfSpecError("packed_only frees the dense weights of packed ones: it needs packed_weights=true")


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
    real rows; their cache slots are overwritten before any forward reads them). On CPU a
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
    if attention_mask is None and cache.fixed_keys:
        attention_mask = causal_mask(model, start, width, cache.max_len, tokens.device)
    step = draft_step(model) if attention_mask is None and position_ids is None and pad <= 0 else None
    if step is not None:  # a draft forward whose kept sublayers all run fused (selfspec.draft.fused.FusedStep)
        logits = step(tokens, start, cache, keep)
        if logits is not None:
            return logits
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
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
        # exact mode: the same cache length (the keys every forward attends over) for every method
        slots = cfg.rows if cfg.exact else extra_slots + cfg.rows
        self.cache = PositionalKVCache(model, max_len=need + slots, fixed_keys=cfg.exact)
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
            return int(logits.argmax(-1))
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
            decode_attention(model, cfg.attention == "decode"):
        run.start()
        while not run.done:
            run.plain_step()
    return run.finish()


class AdaptiveThreshold:
    """The adaptive draft exit's threshold: up by ``step`` after a round while the running
    acceptance is under ``target``, down otherwise (Draft & Verify). The decoding loop and the
    search's round simulator (:mod:`selfspec.search.simulate`) both use this one rule."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.value = cfg.threshold
        self.step, self.target, self.on = cfg.threshold_step, cfg.target_acceptance, cfg.adaptive
        self.ema_acceptance: float | None = None

    def stops_after(self, confidence: float) -> bool:
        """Whether drafting stops after a token drafted with this probability."""
        return self.on and confidence < self.value

    def update(self, drafted: int, accepted: int) -> None:
        self.ema_acceptance = _ema(self.ema_acceptance, accepted / drafted)
        if self.on:
            up = self.ema_acceptance < self.target
            self.value = min(0.99, max(0.0, self.value + (self.step if up else -self.step)))


class Speculator:
    """Draft / verify rounds on top of a :class:`Request`."""

    def __init__(self, run: Request, path: DraftPath) -> None:
        self.run = run
        self.cfg = run.cfg
        self.path = path
        opts = path.options
        self.ngram = NGramIndex(opts.ngram, opts.min_ngram or None, opts.copy_per_match) if opts.ngram else None
        self.threshold = AdaptiveThreshold(self.cfg)
        self.tree = path.options.tree
        fallback = path.options.copy_fallback
        self.fallback = NGramIndex(fallback) if fallback and self.tree else None  # shorter matches, in trees
        self.alternates: list[tuple[int, int]] = []  # (draft index, 2nd-best token) of the last model draft
        self.ema_tokens: float | None = None
        self.ema_verify: float | None = None
        self.ema_round: float | None = None
        self.speculating = True
        # the model-draft gate: running tokens per second of model-drafted rounds and of plain steps
        self.model_rounds = 0
        self.model_rate: float | None = None
        self.plain_rate: float | None = None
        self.since_probe = 0  # plain steps the gate took since the last model round

    def start(self) -> None:
        self.path.prepare(self.run.prompt)
        self.run.start()
        for index in (self.ngram, self.fallback):
            if index is not None:
                index.extend(self.run.prompt.tolist())

    def copy_draft(self, k: int) -> tuple[list[int], list[torch.Tensor]]:
        """Up to ``k`` tokens copied from the context after a repeat of its last n tokens."""
        if self.ngram is None:
            return [], []
        run = self.run
        self.ngram.extend(run.out[len(self.ngram.tokens) - run.prompt.numel():])  # catch up with the context
        drafts = self.ngram.propose(k)
        # the proposal distribution is a point mass
        qs = [] if self.cfg.sampling.greedy else [self.point_mass(t) for t in drafts]
        return drafts, qs

    def point_mass(self, token: int) -> torch.Tensor:
        q = torch.zeros(self.run.model.get_output_embeddings().weight.shape[0], device=self.run.device)
        q[token] = 1.0
        return q

    def draft(self, k: int) -> tuple[list[int], list[torch.Tensor]]:
        """Up to ``k`` draft tokens from the drafting model, starting at the pending token."""
        run, greedy = self.run, self.cfg.sampling.greedy
        drafts: list[int] = []
        qs: list[torch.Tensor] = []
        x = run.pending
        branch = self.path.options.branch_below if self.tree else 0.0
        self.alternates = []
        with self.path.drafting():
            for j in range(k):
                logits = run.forward(run.token_tensor([x]), run.pos + j, keep=1, rows=1)[-1]
                if greedy and branch:
                    top = logits.float().softmax(-1).topk(2)
                    x, conf = int(top.indices[0]), float(top.values[0])
                    if conf < branch:
                        self.alternates.append((j, int(top.indices[1])))
                elif greedy:
                    x = int(logits.argmax(-1))
                    conf = float(logits.float().softmax(-1).max()) if self.cfg.adaptive else 1.0
                else:
                    q = probs_from_logits(logits, self.cfg.sampling)
                    x = int(sample(q, run.generator))
                    qs.append(q)
                    conf = float(q.max())
                    if conf < branch:  # the likeliest token the draw did not pick, as a chosen candidate
                        top = q.topk(2).indices.tolist()
                        self.alternates.append((j, top[1] if top[0] == x else top[0]))
                drafts.append(x)
                if self.threshold.stops_after(conf):
                    break
        return drafts, qs

    def verify(self, drafts: list[int], qs: list[torch.Tensor]) -> tuple[int, int]:
        run = self.run
        tokens = run.token_tensor([run.pending] + drafts)
        logits = run.forward(tokens, run.pos, keep=len(drafts) + 1)
        draft_t = tokens[1:]
        if self.cfg.sampling.greedy:
            return verify_greedy(draft_t, logits)
        p = probs_from_logits(logits, self.cfg.sampling)
        return verify_sampling(draft_t, torch.stack(qs), p, run.generator)

    def draft_tree(self, k: int, room: int) -> DraftTree | None:
        """The round's candidates as a tree: distinct copy continuations (latest match first) or,
        without a match, the model's draft with its 2nd-best tokens at low-confidence positions,
        then the continuations of shorter (``copy_fallback``-token) matches. None when there is no
        match and the gate says a model draft does not pay."""
        run, opts = self.run, self.path.options
        tree = DraftTree(run.pending, opts.tree_nodes)
        found = []
        if self.ngram is not None:
            self.ngram.extend(run.out[len(self.ngram.tokens) - run.prompt.numel():])
            found = self.ngram.propose_many(min(opts.copy_tokens or k, room), opts.copy_candidates)
        for rank, cont in enumerate(found, 1):
            tree.add_path(cont, f"copy#{rank}")
        if found:
            run.stats.copy_rounds += 1
            run.stats.short_copy_rounds += self.ngram.matched < self.ngram.n
            return tree
        if not self.model_draft_pays():
            return None
        drafts, qs = self.draft(k)
        nodes = tree.add_path(drafts, "model", proposals=qs)
        for j, alt in self.alternates:
            if j <= len(nodes):
                tree.add_path([alt], "model#2", parent=nodes[j - 1] if j else 0)
        if self.fallback is not None:
            self.fallback.extend(run.out[len(self.fallback.tokens) - run.prompt.numel():])
            found = self.fallback.propose_many(min(opts.copy_tokens or k, room), opts.copy_candidates)
            for rank, cont in enumerate(found, 1):
                tree.add_path(cont, f"copy{self.fallback.n}#{rank}")
        return tree

    def verify_tree(self, tree: DraftTree) -> tuple[list[int], int]:
        """One full-depth forward over every node; the accepted path's rows moved to the committed slots."""
        run, greedy = self.run, self.cfg.sampling.greedy
        if tree.is_chain:
            qs = [] if greedy else [q if q is not None else self.point_mass(t)
                                    for t, q in zip(tree.tokens[1:], tree.proposal[1:])]
            n, nxt = self.verify(tree.tokens[1:], qs)
            return list(range(1, n + 1)), nxt
        n = len(tree.tokens)
        depth = torch.tensor(tree.depth, dtype=torch.long, device=run.device)
        logits = forward_at(run.model, run.cache, run.token_tensor(tree.tokens), run.pos, keep=n,
                            position_ids=run.pos + depth,
                            attention_mask=tree_attention_mask(run.model, tree, run.pos, run.device))
        if greedy:
            path, nxt = tree.accept_greedy(logits.argmax(-1).tolist())
        else:
            path, nxt = tree.accept_sampling(probs_from_logits(logits, self.cfg.sampling), run.generator)
        moved = [(run.pos + node, run.pos + d) for d, node in enumerate(path, 1) if node != d]
        run.cache.move_rows([m[0] for m in moved], [m[1] for m in moved])
        stats = run.stats
        stats.tree_rounds += 1
        stats.tree_nodes += tree.drafted
        won = tree.winner(path)
        stats.tree_wins[won] = stats.tree_wins.get(won, 0) + 1
        return path, nxt

    def tree_round(self, k: int, room: int) -> None:
        run, stats = self.run, self.run.stats
        t0 = run.clock.now()
        copies = stats.copy_rounds
        tree = self.draft_tree(k, room)
        if tree is None:
            self.gated_step()
            return
        t1 = run.clock.now()
        path, nxt = self.verify_tree(tree)
        n = len(path)
        run.pos += n + 1
        run.pending = nxt
        kinds = ["copy" if tree.source[i].startswith("copy") else "draft" for i in path]
        kept = run.emit([tree.tokens[i] for i in path] + [nxt], kinds + ["verify"])
        t2 = run.clock.now()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.record_round(tree.max_depth, n)
        stats.record_tokens(len(kept), t2 - t0)
        self.adapt(tree.max_depth, n, t2 - t1, t2 - t0)
        if stats.copy_rounds == copies:  # drafted by the model
            self.model_round_done(n + 1, t2 - t0)

    def model_draft_pays(self) -> bool:
        """Whether a round with no copy match should draft with the model: never for a copy-only draft;
        with the gate on, while model rounds measure at least as fast as plain steps."""
        if not self.path.options.model_draft:
            return False
        if not self.cfg.gate or self.model_rounds < self.cfg.fallback_min_rounds:
            return True
        if self.plain_rate is None:  # take one plain step to time it: a verify pass is no stand-in for one on a
            return False             # CPU where extra rows cost (AVX2: a 6-row verify costs 2.6 plain steps)
        return self.model_rate >= self.plain_rate or self.since_probe >= self.cfg.gate_probe

    def gated_step(self) -> None:
        """A plain step in place of a model draft that does not pay (or that a copy-only draft never makes)."""
        run = self.run
        t0 = run.clock.now()
        run.plain_step()
        self.plain_rate = _ema(self.plain_rate, 1.0 / max(run.clock.now() - t0, 1e-9))
        run.stats.gated_steps += 1
        self.since_probe += 1

    def model_round_done(self, tokens: int, seconds: float) -> None:
        self.model_rounds += 1
        self.model_rate = _ema(self.model_rate, tokens / max(seconds, 1e-9))
        self.since_probe = 0

    def round(self) -> None:
        run, stats = self.run, self.run.stats
        room = self.cfg.max_new_tokens - len(run.out) - 1
        k = min(self.cfg.k, room)
        if k < 1 or not self.speculating:
            run.plain_step()
            return
        if self.tree:
            self.tree_round(k, room)
            return
        t0 = run.clock.now()
        drafts, qs = self.copy_draft(min(self.path.options.copy_tokens or k, room))
        copied = bool(drafts)
        if copied:
            stats.copy_rounds += 1
            stats.short_copy_rounds += self.ngram.matched < self.ngram.n
        elif not self.model_draft_pays():
            self.gated_step()
            return
        else:
            drafts, qs = self.draft(k)
        t1 = run.clock.now()
        n, nxt = self.verify(drafts, qs)
        run.pos += n + 1
        run.pending = nxt
        kept = run.emit(drafts[:n] + [nxt], ["copy" if copied else "draft"] * n + ["verify"])
        t2 = run.clock.now()
        stats.draft_time += t1 - t0
        stats.verify_time += t2 - t1
        stats.record_round(len(drafts), n)
        stats.record_tokens(len(kept), t2 - t0)
        self.adapt(len(drafts), n, t2 - t1, t2 - t0)
        if not copied:
            self.model_round_done(n + 1, t2 - t0)

    def adapt(self, drafted: int, accepted: int, verify_time: float, round_time: float) -> None:
        ema = _ema
        self.threshold.update(drafted, accepted)
        self.ema_tokens = ema(self.ema_tokens, accepted + 1.0)
        self.ema_verify = ema(self.ema_verify, verify_time)
        self.ema_round = ema(self.ema_round, round_time)
        if (
            self.cfg.fallback
            and self.run.stats.rounds >= self.cfg.fallback_min_rounds
            and self.ema_tokens * self.ema_verify < self.ema_round
        ):
            self.speculating = False
            self.run.stats.fell_back_at = len(self.run.out)


def _ema(old: float | None, new: float, beta: float = 0.8) -> float:
    return new if old is None else beta * old + (1.0 - beta) * new


def self_speculative(model, prompt_ids, plan: SkipPlan, cfg: DecodeConfig, eos_ids=(),
                     draft: DraftPath | None = None) -> Generation:
    """Draft with ``plan``'s sublayers skipped, verify with the full model, on one cache.

    ``draft`` (a :class:`~selfspec.draft.path.DraftPath` built for ``plan``) makes
    draft steps cheaper still (low-precision kept weights, a cut LM head,
    copy drafting); without it the draft is the plan alone.
    """
    if draft is None:
        draft = DraftPath(model, plan, DraftOptions())
    elif draft.plan != plan or draft.model is not model:
        raise SelfSpecError("the draft path was built for another plan or model")
    opts = draft.options
    longest = max(cfg.k, opts.copy_tokens if opts.ngram else 0, opts.tree_nodes if opts.tree else 0)
    if cfg.exact and opts.tree:
        raise SelfSpecError("exact greedy verifies chains: draft trees (copy_candidates > 1, branch_below > 0) "
                            "are not supported with exact=true")
    if cfg.exact and longest + 1 > cfg.rows:
        raise SelfSpecError(f"exact greedy needs rows >= the longest verify ({longest + 1} tokens with k={cfg.k}"
                            f"{f', copy_tokens={opts.copy_tokens}' if opts.ngram and opts.copy_tokens else ''}); "
                            f"got rows={cfg.rows}")
    run = Request(model, prompt_ids, cfg, eos_ids, "self_speculative", extra_slots=longest + 1)
    spec = Speculator(run, draft)
    with torch.inference_mode(), packed_weights(model, cfg.packed_weights, cfg.packed_only), \
            decode_attention(model, cfg.attention == "decode"):
        spec.start()
        while not run.done:
            spec.round()
    return run.finish()
