"""Greedy self-speculative rounds simulated exactly, without the decode loop.

For each calibration prompt the full model's greedy continuation ``c`` is
computed once, with its full-model keys/values. Greedy decoding with any draft
emits exactly ``c``; what a draft changes is how the rounds fall. A round
starting at continuation index ``i`` (token ``c[i]`` pending) is replayed as the
loop runs it:

- copy drafting: the n-gram index over ``prompt + c[:i+1]`` proposes tokens;
  their accepted count is their agreement with ``c`` (no forward at all); a copy-only
  draft (``model_draft: false``) takes a plain step where nothing matched;
- model drafting: one teacher-forced forward of the draft (skips, low-precision
  weights, cut head) over ``c[i:i+k]`` at positions ``P+i..``, on top of the
  full-model keys/values of everything before ``P+i`` and its own inside the
  chunk, exactly what the draft sees in a real round while it agrees with the
  target. Accepted = leading agreements; the adaptive exit stops the draft after
  the first token drafted with probability under the threshold, which moves by
  the loop's own rule (:class:`~selfspec.engine.decoding.AdaptiveThreshold`).
  All prompts' pending model rounds run as one batched forward; each chunk sits in
  scratch slots past every prompt's context, so the saved full-model keys/values are
  never overwritten (:class:`_ChunkCache`).
- lazy rows: a chain's round needs the draft's outputs only up to its first miss (fixed
  ``k``) or its adaptive stop, and a row of a forward costs about as much as the forward
  itself once a batch holds more than a few (docs/log.md). So a chain's chunk is drafted
  one position a forward, its own keys/values kept in its prompt's scratch slots between
  forwards, until the round is decided (:func:`_decided`); a tree's needs all ``k``.
- draft trees (:mod:`selfspec.engine.tree`): a copy tree is the trie of the distinct
  continuations, accepted along ``c``; a model draft that branches adds the 2nd-best token
  beside each unsure position, and it is accepted where it is the token the draft got wrong;
  ``copy_fallback`` adds the continuations of shorter matches beside the model draft (the
  trie is built as the engine builds it and accepted along ``c``).
  A tree round costs the verify of its nodes (:class:`RoundCounts` ``tree_rounds``).
- the draft's outputs are remembered: what the draft predicts at chunk position ``j`` of a round
  starting at ``i`` depends only on the draft's forward (skips, weights, head: :func:`forward_key`),
  the prompt and ``c[i:i+j+1]``, never on ``k``, the copy options or the length policy. So a
  round that an earlier simulation of the same draft forward already ran is not run again: a search
  whose trials share a draft forward and differ in their other options runs few forwards after
  the first of them (:attr:`RoundSimulator.forwards` counts those it ran, ``reused`` those it did not,
  ``rows`` the draft positions they computed).

The counts of rounds by drafted length (:class:`RoundCounts`) times the cost
model's seconds give the predicted time (:mod:`selfspec.search.costs`).
Exact for greedy decoding up to floating-point differences between a
teacher-forced chunk and one-token steps (a remembered chunk may also have been
computed in another batch, which can round otherwise in bf16); for the adaptive exit, a draft that
already disagreed may stop at another token than the real one would (its
acceptance is exact, its drafted length an estimate).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from selfspec.draft.copy import NGramIndex
from selfspec.draft.path import DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache, cache_kwargs
from selfspec.engine.decoding import AdaptiveThreshold, DecodeConfig, forward_at
from selfspec.engine.masks import layer_masks
from selfspec.engine.tree import DraftTree
from selfspec.kernels.packed import packed_weights


@dataclass
class RoundCounts:
    """What the rounds of some requests were made of (the first, prefill token not included)."""

    tokens: int = 0  # tokens emitted by rounds and plain steps
    plain_steps: int = 0
    model_rounds: Counter = field(default_factory=Counter)  # tokens drafted by the model -> rounds
    copy_rounds: Counter = field(default_factory=Counter)  # tokens copied from the context -> rounds
    drafted: int = 0
    accepted: int = 0
    # rounds that verified a branching draft tree: (tokens drafted by the model, tree nodes) -> rounds
    # (copy trees draft 0 tokens with the model); a tree's verify covers its nodes + 1 tokens
    tree_rounds: Counter = field(default_factory=Counter)

    @property
    def rounds(self) -> int:
        return sum(self.model_rounds.values()) + sum(self.copy_rounds.values()) + sum(self.tree_rounds.values())

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """Mean accepted length, the verify pass's own token included (as DecodeStats derives it)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else float("nan")

    def add(self, other: RoundCounts) -> None:
        self.tokens += other.tokens
        self.plain_steps += other.plain_steps
        self.model_rounds.update(other.model_rounds)
        self.copy_rounds.update(other.copy_rounds)
        self.tree_rounds.update(other.tree_rounds)
        self.drafted += other.drafted
        self.accepted += other.accepted

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "plain_steps": self.plain_steps, "drafted": self.drafted,
                "accepted": self.accepted, "model_rounds": {str(k): v for k, v in sorted(self.model_rounds.items())},
                "copy_rounds": {str(k): v for k, v in sorted(self.copy_rounds.items())},
                "tree_rounds": {f"{m},{n}": v for (m, n), v in sorted(self.tree_rounds.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> RoundCounts:
        trees = Counter({tuple(int(x) for x in k.split(",")): v for k, v in d.get("tree_rounds", {}).items()})
        return cls(d["tokens"], d["plain_steps"], Counter({int(k): v for k, v in d["model_rounds"].items()}),
                   Counter({int(k): v for k, v in d["copy_rounds"].items()}), d["drafted"], d["accepted"], trees)


def forward_key(spec: DraftSpec) -> tuple:
    """What the draft's forward depends on: its skips, the precision of its kept weights and its head.

    Two drafts with the same key predict the same tokens with the same probabilities on the same
    chunk; they may differ in ``k``, the adaptive exit, copy drafting and the tree options."""
    o = spec.options
    groups = o.group_size if "int4" in (o.weights, o.head_weights) else 0
    return spec.plan.attn, spec.plan.mlp, o.weights, groups, o.head_tokens, o.head_weights


@dataclass(frozen=True)
class Drafted:
    """What a round needs of the draft's teacher-forced logits over ``c[i:i+n]``, per chunk position:
    the predicted token, its probability, and the 2nd-best token."""

    pred: tuple[int, ...]
    conf: tuple[float, ...]
    second: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.pred)

    @classmethod
    def of(cls, logits: torch.Tensor) -> Drafted:
        """From the logits ``[n, V]`` of one round's chunk."""
        logits = logits.float()
        top = logits.topk(2, dim=-1)
        conf = (top.values[:, 0] - logits.logsumexp(-1)).exp()
        return cls(tuple(top.indices[:, 0].tolist()), tuple(conf.tolist()), tuple(top.indices[:, 1].tolist()))

    def extended(self, more: Drafted, at: int) -> Drafted:
        """These outputs up to position ``at``, then ``more`` (the positions from ``at`` on)."""
        return Drafted(self.pred[:at] + more.pred, self.conf[:at] + more.conf, self.second[:at] + more.second)


class _Chunk:
    """What the next batched draft forward writes: its rows of the cache, the first scratch slot, and
    where each row's new positions go past it (``place``'s ``offsets``, one per row, as ``scatter`` indices)."""

    __slots__ = ("rows", "start", "scatter", "slots")

    def __init__(self, start: int) -> None:
        self.rows: slice | torch.Tensor = slice(None)
        self.start = start
        # None: every row writes at the first scratch slot; else (row index [n, 1], slot index [n, width])
        self.scatter: tuple[torch.Tensor, torch.Tensor] | None = None
        self.slots = 0  # scratch slots the forward reads: its widest row's offset + its width

    def place(self, rows: slice | torch.Tensor, offsets: list[int], width: int, device) -> None:
        """Built once a forward, not once a layer: the rows (a bounded slice or an index tensor), and where each
        row's new positions go."""
        self.rows = rows
        self.slots = max(offsets) + width
        if not any(offsets):
            self.scatter = None
            return
        index = torch.arange(rows.start, rows.stop, device=device) if isinstance(rows, slice) else rows
        start = torch.tensor(offsets, device=device) + self.start
        self.scatter = index[:, None], start[:, None] + torch.arange(width, device=device)[None, :]


class _ChunkLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, chunk: _Chunk, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.chunk, self.keys, self.values = chunk, keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        raise RuntimeError("the simulator's cache is allocated up front")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        chunk = self.chunk
        rows, a = chunk.rows, chunk.start  # rows: a slice (a view) or an index tensor (a copy)
        if chunk.scatter is None:
            width = key_states.shape[-2]
            self.keys[rows, :, a : a + width] = key_states
            self.values[rows, :, a : a + width] = value_states
        else:  # each row's new positions after the ones it already holds
            index, slots = chunk.scatter
            self.keys[index, :, slots] = key_states.transpose(1, 2)
            self.values[index, :, slots] = value_states.transpose(1, 2)
        end = a + chunk.slots
        return self.keys[rows, :, :end], self.values[rows, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.chunk.start + self.chunk.slots, 0

    def get_seq_length(self) -> int:
        return self.chunk.start

    def get_max_length(self) -> int:
        return self.keys.shape[-2]


class _ChunkCache(Cache):
    """The full model's keys/values of every calibration prompt, one batch row each, plus scratch slots.

    Row ``b`` holds prompt ``b``'s full-model keys/values at slots = positions ``0 .. len-1``. A
    batched draft forward writes each row's chunk into the same scratch slots ``start ..`` (past
    every row's context) and attends, by its mask, to its own context below the round's first
    position and to its own chunk: the context slots are never overwritten, so nothing is restored.
    """

    def __init__(self, layers: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        self.chunk = _Chunk(start)
        super().__init__(layers=[_ChunkLayer(self.chunk, k, v) for k, v in layers])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.chunk.start

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.chunk.start + self.chunk.slots, 0


class RoundSimulator:
    """Replays the rounds of any draft on fixed prompts and their full-model continuations.

    The prompts' rounds are replayed side by side: each step runs the pending model-drafted
    rounds of all prompts in one batched forward (copy-drafted rounds need none), which reads the
    weights once for all of them.
    """

    def __init__(self, model, prompts: list[list[int]], continuations: list[list[int]], stop_ids=(),
                 lazy: bool = True) -> None:
        self.model = model
        self.stop_ids = stop_ids
        self.lazy = lazy  # chain rounds: draft one position a forward, up to the first miss or the adaptive stop
        self.device = next(model.parameters()).device
        self.prompts = [list(p) for p in prompts]
        self.continuations = [list(c) for c in continuations]
        longest = max((len(c) for c in self.continuations), default=1)
        # everything a round ever finds in the cache, as the full model wrote it
        seqs = [p + c[:-1] for p, c in zip(self.prompts, self.continuations)]
        self.scratch = max((len(s) for s in seqs), default=0)  # the first scratch slot
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.inference_mode(), packed_weights(model), decode_attention(model):
            for b, seq in enumerate(seqs):
                if not seq:
                    continue
                cache = PositionalKVCache(model, max_len=len(seq))
                forward_at(model, cache, self._tensor(seq), 0, keep=1)
                if not layers:
                    # scratch: a chunk of <= longest positions, and a batch's padding past a row's own
                    shape = lambda t: (len(seqs), t.shape[1], self.scratch + 2 * longest, t.shape[3])  # noqa: E731
                    layers = [(torch.zeros(shape(lay.keys), dtype=lay.keys.dtype, device=self.device),
                               torch.zeros(shape(lay.values), dtype=lay.values.dtype, device=self.device))
                              for lay in cache.layers]
                for (keys, values), lay in zip(layers, cache.layers):
                    keys[b, :, : len(seq)] = lay.keys[0, :, : len(seq)]
                    values[b, :, : len(seq)] = lay.values[0, :, : len(seq)]
        self.cache = _ChunkCache(layers, self.scratch) if layers else None
        # forward_key -> (prompt, i) -> the draft's outputs over the longest chunk run from c[i]
        self.memo: dict[tuple, dict[tuple[int, int], Drafted]] = {}
        self.forwards = 0  # chunks (rows of batched draft forwards) run so far
        self.rows = 0  # draft positions computed so far (a lazy chunk's positions, over its forwards)
        self.reused = 0  # chunks answered from the memo

    def _tensor(self, tokens: list[int]) -> torch.Tensor:
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def draft_path(self, spec: DraftSpec) -> DraftPath:
        return DraftPath(self.model, spec.plan, spec.options, stop_ids=self.stop_ids)

    def simulate(self, spec: DraftSpec, path: DraftPath | None = None, prompts: Sequence[int] | None = None,
                 oracle: bool = False) -> RoundCounts:
        """Round counts of ``spec`` over the prompts (all of them, or the indices in ``prompts``).

        ``oracle``: every model-drafted round accepts all it drafted (copy rounds as simulated): the rounds
        of a draft tree that always holds the target's continuation to the draft's depth, the most any
        tree of that depth over this draft can accept (the bound :mod:`scripts.tree_bound` reports)."""
        path = path or self.draft_path(spec)
        rows = list(prompts) if prompts is not None else list(range(len(self.prompts)))
        memo = self.memo.setdefault(forward_key(spec), {})
        total = RoundCounts()
        heads = None
        with torch.inference_mode(), packed_weights(self.model), decode_attention(self.model):
            replays = {b: self._replay(spec, b, oracle) for b in rows}
            pending: dict[int, tuple[int, int, bool]] = {}  # prompt -> the round (i, k, lazy) it waits on
            sent: dict[int, tuple[int, int]] = {}  # prompt -> (i, positions) last sent to its replay
            held: dict[int, tuple[int, int]] = {}  # prompt -> (i, positions) whose keys/values its scratch holds

            def advance(b: int, drafted: Drafted | None) -> None:
                """Run prompt ``b``'s replay to its next request that the memo cannot answer (a replay asks
                for the same round again when the positions it was sent do not decide it)."""
                try:
                    request = next(replays[b]) if drafted is None else replays[b].send(drafted)
                    while True:
                        i = request[0]
                        known = memo.get((b, i), ())
                        if len(known) <= (sent[b][1] if sent.get(b, (None,))[0] == i else 0):
                            break
                        self.reused += 1
                        sent[b] = (i, len(known))
                        request = replays[b].send(known)
                    pending[b] = request
                except StopIteration as done:
                    total.add(done.value)

            for b in rows:
                advance(b, None)
            while pending:
                if heads is None:
                    heads = self._heads(path, rows)
                order = sorted(pending)
                chunks = []
                for b in order:
                    i, k, lazy = pending[b]
                    have = len(memo.get((b, i), ()))
                    start = held[b][1] if held.get(b, (None,))[0] == i else 0  # positions to recompute from
                    chunks.append((b, i, start, min(have + 1, k) if lazy else max(k, have)))
                logits = self._draft_forward(path, chunks, heads)
                self.forwards += len(order)
                pending = {}
                for j, (b, i, start, end) in enumerate(chunks):
                    self.rows += end - start
                    new = Drafted.of(logits[j, : end - start])
                    old = memo.get((b, i))
                    memo[(b, i)] = drafted = old.extended(new, start) if old is not None and start else new
                    held[b] = (i, end)
                    sent[b] = (i, len(drafted))
                    advance(b, drafted)
        return total

    def batches(self, spec: DraftSpec, path: DraftPath, size: int) -> Iterator[tuple[int, RoundCounts]]:
        """The prompts ``size`` at a time: per batch, the index of its last prompt and its round counts."""
        n = len(self.prompts)
        for first in range(0, n, size):
            last = min(first + size, n)
            yield last - 1, self.simulate(spec, path, prompts=range(first, last))

    def _heads(self, path: DraftPath, rows: list[int]) -> dict[int, torch.Tensor] | None:
        """With a cut head: the head scores the union of the rows' ids; per row, the ids outside its own set
        (the base ids, its prompt's tokens) are masked, so each row's logits are its own cut head's."""
        if path.head is None:
            return None
        own = {b: path.head_ids(self._tensor(self.prompts[b])) for b in rows}
        path.choose_head(torch.cat(list(own.values())).unique())
        masks = {}
        for b, ids in own.items():
            outside = torch.ones(path.head.inner.out_features, dtype=torch.bool, device=self.device)
            outside[ids] = False
            masks[b] = outside
        return masks

    def _draft_forward(self, path: DraftPath, chunks: list[tuple[int, int, int, int]],
                       heads: dict[int, torch.Tensor] | None) -> torch.Tensor:
        """One batched draft forward over the chunks ``(prompt, i, start, end)``: each row's ``c[i+start:i+end]``
        teacher-forced at positions ``P+i+start..``, on top of the full-model context below ``P+i`` and the
        row's own keys/values of ``c[i:i+start]`` in its scratch slots (written by its earlier forwards);
        logits ``[rows, widest, V]``."""
        width = max(end - start for _, _, start, end in chunks)
        n, base = len(chunks), self.scratch
        tokens, pos, ctx, offsets = [], [], [], []
        for b, i, start, end in chunks:
            chunk = self.continuations[b][i + start : i + end]
            tokens.append(chunk + [chunk[-1]] * (width - len(chunk)))  # padding: after the real ones, never read
            first = len(self.prompts[b]) + i
            pos.append(list(range(first + start, first + start + width)))
            ctx.append(first)
            offsets.append(start)
        pos_t = torch.tensor(pos, dtype=torch.long)
        ctx_t = torch.tensor(ctx, dtype=torch.long)
        off_t = torch.tensor(offsets, dtype=torch.long)
        slots = torch.arange(base + max(offsets) + width)
        # row b attends to its full-model context (slots below its round's first position) and, causally,
        # to its own chunk in the scratch slots (chunk position = slot - base)
        query = off_t[:, None, None] + torch.arange(width)[None, :, None]
        scratch = (slots[None, None, :] >= base) & (slots[None, None, :] - base <= query)
        allowed = (slots[None, None, :] < ctx_t[:, None, None]) | scratch
        key_pos = torch.where(slots[None, :] < base, slots[None, :], ctx_t[:, None] + slots[None, :] - base)
        mask = layer_masks(self.model, allowed, pos_t, key_pos, self.device)
        cache, rows = self.cache, [b for b, _, _, _ in chunks]
        contiguous = rows == list(range(rows[0], rows[0] + n))
        cache.chunk.place(slice(rows[0], rows[0] + n) if contiguous else torch.tensor(rows, device=self.device),
                          offsets, width, self.device)
        with path.drafting():
            out = self.model(input_ids=torch.tensor(tokens, dtype=torch.long, device=self.device),
                             position_ids=pos_t.to(self.device), **cache_kwargs(self.model, cache), use_cache=True,
                             attention_mask=mask, logits_to_keep=width)
        logits = out.logits
        if heads is not None:
            outside = torch.stack([heads[b] for b, _, _, _ in chunks])
            logits = logits.masked_fill(outside[:, None, :], float("-inf"))
        return logits

    def _replay(self, spec: DraftSpec, index: int,
                oracle: bool = False) -> Generator[tuple[int, int, bool], Drafted, RoundCounts]:
        """The rounds of one prompt, as the loop runs them; yields ``(i, k, lazy)`` for each model-drafted
        round and is sent the draft's outputs over the first positions of ``c[i:i+k]`` (:class:`Drafted`); it
        yields the same round again while those do not decide it (all ``k`` positions, or with ``lazy`` a
        chain's first miss or adaptive stop, :func:`_decided`)."""
        prompt, c = self.prompts[index], self.continuations[index]
        P, L = len(prompt), len(c)
        out = RoundCounts()
        if L <= 1:
            return out
        threshold = AdaptiveThreshold(DecodeConfig(k=spec.k, adaptive=spec.adaptive, threshold=spec.threshold))
        opts = spec.options
        ngram = NGramIndex(opts.ngram, opts.min_ngram or None, opts.copy_per_match) if opts.ngram else None
        tree = opts.tree  # the search simulates greedy decoding, where trees are verified
        fallback = NGramIndex(opts.copy_fallback) if tree and opts.copy_fallback else None
        for idx in (ngram, fallback):
            if idx is not None:
                idx.extend(prompt)
        i = 0  # c[i] is pending: emitted, not yet in the cache
        while i + 1 < L:
            room = L - (i + 1) - 1
            k = min(spec.k, room)
            proposals: list[list[int]] = []
            if k >= 1 and ngram is not None:
                ngram.extend(c[len(ngram.tokens) - P : i + 1])
                proposals = ngram.propose_many(min(opts.copy_tokens or k, room), opts.copy_candidates if tree else 1)
            if k < 1 or (not proposals and not opts.model_draft):  # a plain step (copy-only: where nothing matched)
                out.plain_steps += 1
                out.tokens += 1
                i += 1
                continue
            if proposals:
                t = DraftTree(c[i], opts.tree_nodes if tree else len(proposals[0]))
                for rank, cont in enumerate(proposals, 1):
                    t.add_path(cont, f"copy#{rank}")
                drafted, accepted = t.max_depth, len(t.accept_greedy_along(c[i + 1 :]))
                if t.is_chain:
                    out.copy_rounds[drafted] += 1
                else:
                    out.tree_rounds[(0, t.drafted)] += 1
            else:
                copies = []
                if fallback is not None:
                    fallback.extend(c[len(fallback.tokens) - P : i + 1])
                    copies = fallback.propose_many(min(opts.copy_tokens or k, room), opts.copy_candidates)
                branch = opts.branch_below if tree else 0.0
                if oracle and not threshold.on and not branch and not copies:
                    modelled = nodes = depth = accepted = k  # a fixed k all accepted: no forward needed
                else:
                    lazy = self.lazy and not branch and not copies
                    drafted_out = yield i, k, lazy
                    while not _decided(drafted_out, c, i, k, threshold, lazy):
                        drafted_out = yield i, k, lazy
                    modelled, accepted, nodes, depth = _model_round(
                        drafted_out, c, i, k, threshold, branch, opts.tree_nodes, copies)
                if oracle:
                    accepted = depth
                if nodes > modelled:
                    out.tree_rounds[(modelled, nodes)] += 1
                else:
                    out.model_rounds[modelled] += 1
                drafted = depth
            threshold.update(drafted, accepted)
            out.drafted += drafted
            out.accepted += accepted
            out.tokens += accepted + 1
            i += accepted + 1
        return out


def _decided(out: Drafted, c: list[int], i: int, k: int, threshold: AdaptiveThreshold, lazy: bool) -> bool:
    """Whether the draft's outputs over the first positions of ``c[i:i+k]`` decide the round: all ``k`` of
    them, or for a chain (``lazy``) its adaptive stop, or, drafting a fixed ``k``, its first miss."""
    n = min(len(out), k)
    if n == k:
        return True
    if not lazy:
        return False
    if threshold.on:
        return any(threshold.stops_after(p) for p in out.conf[:n])
    return any(a != b for a, b in zip(out.pred[:n], c[i + 1 : i + 1 + n]))


def _model_round(out: Drafted, c: list[int], i: int, k: int, threshold: AdaptiveThreshold,
                 branch: float = 0.0, budget: int = 0, copies: list[list[int]] = ()) -> tuple[int, int, int, int]:
    """Drafted, accepted, tree nodes and depth of a model-drafted round from the draft's teacher-forced
    outputs ``out`` over ``c[i:i+k]`` (nodes > drafted where it branched: the 2nd-best token beside each draft
    position whose top probability is under ``branch``, then the ``copies`` of shorter matches, under the
    node budget as the engine adds them).

    The draft's tokens are teacher-forced: exact up to its first miss, which is all acceptance needs.
    Past the miss the real draft's branches and tokens may differ, so where the node budget binds the
    node count of a tree with copies may differ from the real one's by a few."""
    pred, conf, second = out.pred[:k], out.conf[:k], out.second[:k]
    drafted = k
    if threshold.on:
        drafted = next((j + 1 for j in range(k) if threshold.stops_after(conf[j])), k)
    accepted = _leading_agreements(pred[:drafted], c[i + 1 : i + 1 + drafted])
    alternates = [j for j in range(drafted) if conf[j] < branch][: max(budget - drafted, 0)] if branch else []
    if not copies:
        if accepted < drafted and accepted in alternates and second[accepted] == c[i + 1 + accepted]:
            accepted += 1  # the 2nd-best leaf beside the first wrong draft is the target's token
        return drafted, accepted, drafted + len(alternates), drafted
    t = DraftTree(c[i], budget)
    nodes = t.add_path(pred[:drafted], "model")
    for j in alternates:
        t.add_path([second[j]], "model#2", parent=nodes[j - 1] if j else 0)
    for cont in copies:
        t.add_path(cont, "copy")
    return drafted, len(t.accept_greedy_along(c[i + 1 :])), t.drafted, t.max_depth


def _leading_agreements(draft: list[int], target: list[int]) -> int:
    n = 0
    for a, b in zip(draft, target):
        if a != b:
            break
        n += 1
    return n


def decode_config_of(spec: DraftSpec, base: DecodeConfig) -> DecodeConfig:
    """``base`` with the draft's length policy (k, adaptive exit, threshold)."""
    return replace(base, k=spec.k, adaptive=spec.adaptive, threshold=spec.threshold)
