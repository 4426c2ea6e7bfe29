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
  the loop's own rule (:class:`~selfspec.engine.speculate.AdaptiveThreshold`); a growing draft's length
  (``k_max``) moves by the loop's rule too (:class:`~selfspec.engine.speculate.DraftLength`).
  All prompts' pending model rounds run as one batched forward; each chunk sits in
  scratch slots past every prompt's context, so the saved full-model keys/values are
  never overwritten (:class:`ChunkCache`).
- lazy rows: a chain's round needs the draft's outputs only up to its first miss (fixed
  ``k``) or its adaptive stop, and a row of a forward costs about as much as the forward
  itself once a batch holds more than a few (docs/log.md). So a chain's chunk is drafted
  one position a forward, its own keys/values kept in its prompt's scratch slots between
  forwards, until the round is decided (:func:`decided`); a tree's needs all ``k``.
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

from collections.abc import Generator, Iterator, Sequence

import torch

from selfspec.draft.copy import NGramIndex
from selfspec.draft.path import DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache, cache_kwargs
from selfspec.engine.decoding import DecodeConfig, forward_at
from selfspec.engine.masks import layer_masks
from selfspec.engine.speculate import AdaptiveThreshold, DraftLength
from selfspec.engine.tree import DraftTree
from selfspec.kernels.packed import packed_weights
from selfspec.search.chunks import ChunkCache
from selfspec.search.rounds import (
    Drafted,
    RoundCounts,
    decided,
    forward_key,
    leading_agreements,
    model_round,
)


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
        self.cache = ChunkCache(layers, self.scratch) if layers else None
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
                 oracle: bool = False, stop: bool = False, copy_inside: bool = False) -> RoundCounts:
        """Round counts of ``spec`` over the prompts (all of them, or the indices in ``prompts``).

        ``oracle``: every model-drafted round accepts all it drafted (copy rounds as simulated): the rounds
        of a draft tree that always holds the target's continuation to the draft's depth, the most any
        tree of that depth over this draft can accept (the bound :mod:`scripts.tree_bound` reports).
        ``stop``: every model-drafted chain stops where the target's continuation does, drafting the tokens it
        will accept and no more (a round that would accept none takes a plain step): the most any rule that
        decides when to stop drafting can save over this draft at its depth.
        ``copy_inside``: a model-drafted chain turns to copying at the first of its tokens, while they agree with the
        target, after which the context's last n tokens have an earlier occurrence: the round verifies the draft's
        tokens so far and the copy as one chain, booked with the tree rounds (``(drafted, nodes)``, a verify of all
        their tokens after the model's draft steps). Exact for that policy where a round turns before its first miss;
        past a miss, where the policy could turn too, the round stays the draft's chain (it accepts the same tokens
        either way, drafted and verified otherwise)."""
        path = path or self.draft_path(spec)
        rows = list(prompts) if prompts is not None else list(range(len(self.prompts)))
        memo = self.memo.setdefault(forward_key(spec), {})
        total = RoundCounts()
        heads = None
        with torch.inference_mode(), packed_weights(self.model), decode_attention(self.model):
            replays = {b: self._replay(spec, b, oracle, stop, copy_inside) for b in rows}
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
                oracle: bool = False, stop: bool = False,
                copy_inside: bool = False) -> Generator[tuple[int, int, bool], Drafted, RoundCounts]:
        """The rounds of one prompt, as the loop runs them; yields ``(i, k, lazy)`` for each model-drafted
        round and is sent the draft's outputs over the first positions of ``c[i:i+k]`` (:class:`Drafted`); it
        yields the same round again while those do not decide it (all ``k`` positions, or with ``lazy`` a
        chain's first miss or adaptive stop, :func:`decided`)."""
        prompt, c = self.prompts[index], self.continuations[index]
        P, L = len(prompt), len(c)
        out = RoundCounts()
        if L <= 1:
            return out
        policy = DecodeConfig(**spec.length)
        threshold, length = AdaptiveThreshold(policy), DraftLength(policy)
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
                proposals = ngram.propose_many(min(opts.copy_limit(k), room), opts.copy_candidates if tree else 1)
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
                k = min(length.value, room)  # a model draft's length (copies keep spec.k's limits)
                copies = []
                if fallback is not None:
                    fallback.extend(c[len(fallback.tokens) - P : i + 1])
                    copies = fallback.propose_many(min(opts.copy_limit(k), room), opts.copy_candidates)
                branch = opts.branch_below if tree else 0.0
                if oracle and not threshold.on and not branch and not copies:
                    modelled = nodes = depth = accepted = k  # a fixed k all accepted: no forward needed
                else:
                    lazy = self.lazy and not branch and not copies
                    drafted_out = yield i, k, lazy
                    while not decided(drafted_out, c, i, k, threshold, lazy):
                        drafted_out = yield i, k, lazy
                    modelled, accepted, nodes, depth = model_round(
                        drafted_out, c, i, k, threshold, branch, opts.tree_nodes, copies)
                if oracle:
                    accepted = depth
                elif copy_inside and ngram is not None and nodes <= modelled:
                    for j in range(1, min(accepted, modelled) + 1):  # the draft's tokens so far are the target's
                        ngram.extend(c[len(ngram.tokens) - P : i + 1 + j])
                        # a copy as long as a round's copy, the round no wider than the widest verify the loop makes
                        found = ngram.propose(min(opts.copy_limit(k), opts.longest_verify(k) - j, room - j))
                        if found:  # j model tokens, then the copy: verified as one chain of their tokens
                            accepted = j + leading_agreements(found, c[i + 1 + j :])
                            modelled, nodes = j, j + len(found)
                            depth = nodes
                            break
                elif stop and nodes <= modelled and accepted < modelled:  # a chain drafts what it will accept
                    if not accepted:
                        out.plain_steps += 1
                        out.tokens += 1
                        i += 1
                        continue
                    modelled = depth = nodes = accepted
                length.update(modelled, accepted)
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
