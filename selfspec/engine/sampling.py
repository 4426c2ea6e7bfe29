"""Sampling and verification as pure functions.

Notation (kept across the project): ``p`` target probabilities, ``q`` draft
probabilities, ``k`` drafted tokens per round. Randomness only ever comes from
an explicit ``torch.Generator``; nothing here reads global RNG state.

Invariant: :func:`verify_sampling` returns tokens distributed exactly as the
target's own sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft
token ``x`` with probability ``min(1, p(x)/q(x))``, on the first rejection
resample from ``norm(max(0, p - q))``, and when all ``k`` are accepted draw a
bonus token from ``p`` at position ``k+1``. :func:`verify_greedy` keeps the
longest prefix that equals the target's argmax and appends the target's next
argmax, so greedy output is token-identical to greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.errors import SelfSpecError


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SelfSpecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SelfSpecError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SelfSpecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# top-p looks for the nucleus among this many most likely tokens first (a partial top-k), widening
# the search only when they hold less than top_p of the mass: a full sort of a 150k vocabulary costs
# about as much as a decode step of a 0.5B model on a 2-core CPU (docs/log.md)
_NUCLEUS_FIRST = 256


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Turn logits ``[..., V]`` into the sampling distribution ``[..., V]`` (float32).

    Temperature first, then top-k, then top-p (nucleus) filtering; the same
    transform is applied to draft and target so that ``p`` and ``q`` live on
    the same support rules. Top-p keeps the most likely tokens while the mass
    strictly before a token is under ``top_p``.
    """
    if params.greedy:
        raise ValueError("probs_from_logits is for sampling; greedy decoding uses argmax")
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if params.top_k and params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        m = min(vocab, _NUCLEUS_FIRST)
        while True:
            top, order = torch.topk(probs, m, dim=-1)  # sorted, most likely first
            before = top.cumsum(-1) - top
            if m == vocab or bool((before[..., -1] >= params.top_p).all()):
                break  # every row's nucleus ends inside the first m tokens
            m = min(vocab, m * 8)
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < params.top_p)
        probs = probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token id per row of ``probs`` ``[..., V]`` → ``[...]`` (int64), by inverting the
    cumulative distribution at one uniform draw per row (``torch.multinomial`` over a 150k
    vocabulary costs several times more on CPU). A token of probability 0 is never drawn."""
    flat = probs.reshape(-1, probs.shape[-1]).float()
    cdf = flat.cumsum(-1)
    u = torch.rand(flat.shape[0], 1, generator=generator, device=flat.device, dtype=torch.float32)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    # u * total rounds up to total only when u is within float epsilon of 1: take the last possible token
    last = flat.shape[-1] - 1 - (flat.flip(-1) > 0).int().argmax(-1, keepdim=True)
    idx = torch.minimum(idx, last)
    return idx.reshape(probs.shape[:-1])


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """The argmax over the last dimension: bf16/fp16 logits are compared in fp32 (exact, so the same ids, the first of
    equal maxima as ``argmax`` picks it), where torch's CPU argmax runs faster than on bf16: 0.17 against 0.55 ms for
    one 152k-token row of the 0.5B's logits on a 2-core Zen 4, 0.07 against 0.26 ms a row in blocks of 6
    (``scripts/sampler_bench.py``, ``results/sampler.jsonl``)."""
    return (logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits).argmax(-1)


def verify_greedy(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification.

    ``draft``: ``[k]`` drafted ids; ``target_logits``: ``[k+1, V]`` target logits
    at the positions that predict draft[0..k-1] and the token after them.
    Returns ``(n_accepted, next_token)``: the first ``n_accepted`` drafts are
    kept and ``next_token`` (the target's argmax after them) follows.
    """
    target = greedy_ids(target_logits)
    k = draft.shape[0]
    mismatch = (draft != target[:k]).nonzero()
    n = int(mismatch[0, 0]) if mismatch.numel() else k
    return n, int(target[n])


def verify_sampling(
    draft: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative-sampling verification.

    ``draft``: ``[k]`` ids sampled from ``q`` ``[k, V]``; ``p``: ``[k+1, V]``
    target probabilities. Returns ``(n_accepted, next_token)`` where
    ``next_token`` is the residual resample on rejection or the bonus token.
    """
    k = draft.shape[0]
    if k:
        idx = torch.arange(k, device=draft.device)
        p_x = p[idx, draft]
        q_x = q[idx, draft]
        u = torch.rand(k, generator=generator, device=p.device, dtype=torch.float32)
        # accept when u * q(x) <= p(x), i.e. u <= p/q without dividing by zero
        rejected = (u * q_x > p_x).nonzero()
        if rejected.numel():
            n = int(rejected[0, 0])
            residual = (p[n] - q[n]).clamp_min(0.0)
            total = residual.sum()
            # total == 0 only when p == q exactly, where rejection has probability 0
            dist = residual / total if total > 0 else p[n]
            return n, int(sample(dist, generator))
    return k, int(sample(p[k], generator))
