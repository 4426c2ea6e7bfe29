"""Decoding statistics: raw counters, one clock, derived rates in one place.

The autoregressive baseline and self-speculative decoding fill the same
:class:`DecodeStats` through the same :class:`Clock`, so tokens are counted
and time is measured identically for both. Counters are raw (rounds, drafted,
accepted, accepted per draft position, times); every rate is derived in
:meth:`DecodeStats.summary` and nowhere else. "Mean accepted length" counts
the token the verify pass adds in each round (the bonus or correction token).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

import torch


class Clock:
    """Monotonic clock in seconds that covers the device work queued before each reading.

    On CPU this is ``time.perf_counter``. On CUDA a reading records a CUDA event on
    the current stream, waits for it, and returns its time since the clock's first
    event, so a reading covers the kernels launched before it (on an H200 it agreed with a
    synchronized wall clock within 1 ms: scripts/device_check.py).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._origin = None

    def now(self) -> float:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        event.synchronize()
        if self._origin is None:
            self._origin = event
        return self._origin.elapsed_time(event) / 1000.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), q))


@dataclass
class DecodeStats:
    """Raw counters of one generation call."""

    method: str = ""
    requests: int = 1  # generation calls merged into these counters (turns of a multi-turn sample)
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0  # verify passes of speculative rounds
    copy_rounds: int = 0  # rounds whose draft was copied from the context (n-gram match)
    short_copy_rounds: int = 0  # of those, rounds copied after a match shorter than n (DraftOptions.min_ngram)
    plain_steps: int = 0  # one-token target steps (baseline, fallback, gate, last token)
    gated_steps: int = 0  # of those, steps taken in place of a model draft (DecodeConfig.gate; copy-only drafts)
    drafted: int = 0
    accepted: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    step_time: float = 0.0  # time spent in plain one-token steps
    ttft: float = 0.0  # start of the call to the first new token (summed over merged requests)
    total_time: float = 0.0
    token_latencies: list[float] = field(default_factory=list)
    stop_reason: str = ""  # "eos" | "max_new_tokens"
    fell_back_at: int | None = None  # new-token count when speculation was switched off
    tree_rounds: int = 0  # rounds that verified a branching draft tree
    tree_nodes: int = 0  # drafted nodes those rounds verified
    tree_wins: dict[str, int] = field(default_factory=dict)  # candidate the accepted path came from -> rounds

    # -- recording ---------------------------------------------------------------
    def record_round(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def record_tokens(self, n: int, elapsed: float) -> None:
        """``n`` tokens became available after ``elapsed`` seconds of work."""
        if n <= 0:
            return
        self.new_tokens += n
        self.token_latencies.extend([elapsed / n] * n)

    @classmethod
    def merged(cls, parts: list[DecodeStats]) -> DecodeStats:
        """One set of counters for several requests (the turns of one sample)."""
        out = cls(method=parts[0].method, requests=0)
        for p in parts:
            for name in ("requests", "prompt_tokens", "new_tokens", "rounds", "copy_rounds", "short_copy_rounds",
                         "plain_steps", "gated_steps",
                         "drafted", "accepted", "prefill_time", "draft_time", "verify_time", "step_time", "ttft", "total_time",
                         "tree_rounds", "tree_nodes"):
                setattr(out, name, getattr(out, name) + getattr(p, name))
            for mine, theirs in ((out.drafted_per_position, p.drafted_per_position),
                                 (out.accepted_per_position, p.accepted_per_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, v in enumerate(theirs):
                    mine[i] += v
            out.token_latencies.extend(p.token_latencies)
            for name, v in p.tree_wins.items():
                out.tree_wins[name] = out.tree_wins.get(name, 0) + v
            out.stop_reason = p.stop_reason
            if out.fell_back_at is None and p.fell_back_at is not None:
                out.fell_back_at = p.fell_back_at
        return out

    def counters(self) -> dict:
        """The raw counters as plain values (what a results row stores)."""
        return asdict(self)

    @classmethod
    def from_counters(cls, counters: dict) -> DecodeStats:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in counters.items() if k in known})

    # -- derived -----------------------------------------------------------------
    def summary(self) -> dict:
        """All derived rates, computed here and only here.

        Over merged requests, ``ttft_s`` is the mean time to first token and
        ``tpot_s`` the decode time per token after each request's first.
        """
        decode_time = self.total_time - self.ttft
        after_first = max(self.new_tokens - self.requests, 0)
        return {
            "method": self.method,
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "rounds": self.rounds,
            "copy_rounds": self.copy_rounds,
            "plain_steps": self.plain_steps,
            "gated_steps": self.gated_steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else float("nan"),
            "mean_accepted_length": 1.0 + self.accepted / self.rounds if self.rounds else float("nan"),
            "acceptance_by_position": [
                a / d if d else float("nan")
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)
            ],
            "total_time_s": self.total_time,
            "tokens_per_s": self.new_tokens / self.total_time if self.total_time > 0 else float("nan"),
            "ttft_s": self.ttft / self.requests if self.requests else float("nan"),
            "tpot_s": decode_time / after_first if after_first else float("nan"),
            "latency_p50_s": percentile(self.token_latencies, 0.5),
            "latency_p99_s": percentile(self.token_latencies, 0.99),
            "prefill_time_s": self.prefill_time,
            "draft_time_s": self.draft_time,
            "verify_time_s": self.verify_time,
            "step_time_s": self.step_time,
            "stop_reason": self.stop_reason,
            "fell_back_at": self.fell_back_at,
            "tree_rounds": self.tree_rounds,
            "nodes_per_tree_round": self.tree_nodes / self.tree_rounds if self.tree_rounds else float("nan"),
            "tree_wins": dict(self.tree_wins),
        }
