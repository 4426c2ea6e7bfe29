"""Self-speculative decoding: rounds of a cheap draft and one full-depth verify, on :class:`~selfspec.engine.decoding.Request`.

A :class:`Speculator` holds the policies of one request: copy drafting or a model draft, a chain or a tree of
candidates, the adaptive draft exit (:class:`AdaptiveThreshold`), the gate that takes a plain step where a model
draft does not pay, and the fallback to plain decoding when speculation measures slower. Positions, the cache,
the clock and the token bookkeeping stay the :class:`~selfspec.engine.decoding.Request`'s, shared with the
autoregressive baseline.
"""

from __future__ import annotations

import torch

from selfspec.draft.copy import NGramIndex
from selfspec.draft.path import DraftOptions, DraftPath
from selfspec.engine.attention import decode_attention
from selfspec.engine.decoding import DecodeConfig, Generation, Request, forward_at
from selfspec.engine.sampling import (
    greedy_ids,
    probs_from_logits,
    sample,
    verify_greedy,
    verify_sampling,
)
from selfspec.engine.tree import DraftTree, tree_attention_mask
from selfspec.errors import SelfSpecError
from selfspec.kernels.packed import packed_weights
from selfspec.model.plan import SkipPlan


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


class DraftLength:
    """How many tokens the next model draft may make: ``k``, or, with ``k_max`` above it, one more after each
    model-drafted round that drafted that many and had all of them accepted (up to ``k_max``) and ``k`` again after
    any other model round: longer drafts where the request's own rounds say the draft stays right over many tokens.
    The decoding loop and the search's round simulator (:mod:`selfspec.search.simulate`) both use this one rule."""

    def __init__(self, cfg: DecodeConfig) -> None:
        self.base, self.top = cfg.k, cfg.longest_draft
        self.value = cfg.k

    def update(self, drafted: int, accepted: int) -> None:
        """After a model-drafted round: ``drafted`` tokens drafted, the first ``accepted`` of them accepted."""
        if self.top > self.base:
            whole = drafted == accepted == self.value
            self.value = min(self.value + 1, self.top) if whole else self.base


class Speculator:
    """Draft / verify rounds on top of a :class:`Request`."""

    def __init__(self, run: Request, path: DraftPath) -> None:
        self.run = run
        self.cfg = run.cfg
        self.path = path
        opts = path.options
        self.ngram = NGramIndex(opts.ngram, opts.min_ngram or None, opts.copy_per_match) if opts.ngram else None
        self.threshold = AdaptiveThreshold(self.cfg)
        self.length = DraftLength(self.cfg)
        self.tree = path.options.tree
        fallback = path.options.copy_fallback
        self.fallback = NGramIndex(fallback) if fallback and self.tree else None  # shorter matches, in trees
        self.alternates: list[tuple[int, int]] = []  # (draft index, 2nd-best token) of the last model draft
        self.drafted = 0  # tokens the last model draft made
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
                    x = int(greedy_ids(logits))
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
        self.drafted = len(drafts)
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
            found = self.ngram.propose_many(min(opts.copy_limit(k), room), opts.copy_candidates)
        for rank, cont in enumerate(found, 1):
            tree.add_path(cont, f"copy#{rank}")
        if found:
            run.stats.copy_rounds += 1
            run.stats.short_copy_rounds += self.ngram.matched < self.ngram.n
            return tree
        if not self.model_draft_pays():
            return None
        drafts, qs = self.draft(min(self.length.value, room))
        nodes = tree.add_path(drafts, "model", proposals=qs)
        for j, alt in self.alternates:
            if j <= len(nodes):
                tree.add_path([alt], "model#2", parent=nodes[j - 1] if j else 0)
        if self.fallback is not None:
            self.fallback.extend(run.out[len(self.fallback.tokens) - run.prompt.numel():])
            found = self.fallback.propose_many(min(opts.copy_limit(k), room), opts.copy_candidates)
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
            path, nxt = tree.accept_greedy(greedy_ids(logits).tolist())
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
            self.length.update(self.drafted, n)
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
        drafts, qs = self.copy_draft(min(self.path.options.copy_limit(k), room))
        copied = bool(drafts)
        if copied:
            stats.copy_rounds += 1
            stats.short_copy_rounds += self.ngram.matched < self.ngram.n
        elif not self.model_draft_pays():
            self.gated_step()
            return
        else:
            drafts, qs = self.draft(min(self.length.value, room))
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
            self.length.update(len(drafts), n)
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
    longest = opts.longest_verify(cfg.longest_draft)
    run = Request(model, prompt_ids, cfg, eos_ids, "self_speculative", extra_slots=longest + 1)
    spec = Speculator(run, draft)
    with torch.inference_mode(), packed_weights(model, cfg.packed_weights, cfg.packed_only), \
            decode_attention(model, cfg.attention == "decode", cfg.row_invariant):
        spec.start()
        while not run.done:
            spec.round()
    return run.finish()
