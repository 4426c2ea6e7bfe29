"""Copy drafting (prompt lookup): propose what followed an earlier occurrence of the last n tokens."""

from __future__ import annotations

# earlier occurrences of one n-gram kept for multi-candidate copy drafting (the latest ones)
_KEPT_OCCURRENCES = 16


class NGramIndex:
    """Where each n-gram of the context occurred (the latest few times), for copy drafting.

    With ``shortest`` below ``n``, a lookup whose last n tokens never occurred before falls back
    to the last n-1 tokens, then n-2, down to ``shortest`` (prompt lookup's rule: the longest
    match wins); :attr:`matched` says how long the last lookup's match was (0: none).
    With ``per_match`` c >= 1, a match of m tokens proposes at most c*m tokens: a short match
    is right less often, and a long wrong copy makes the verify forward wider for nothing.
    """

    def __init__(self, n: int, shortest: int | None = None, per_match: int = 0) -> None:
        self.n = n
        self.shortest = shortest or n
        if not 1 <= self.shortest <= n:
            raise ValueError(f"shortest match must be between 1 and n={n}, got {shortest}")
        if per_match < 0:
            raise ValueError(f"per_match must be >= 0 (0: every match copies up to k), got {per_match}")
        self.per_match = per_match
        self.tokens: list[int] = []
        # keyed by the m-gram itself: grams of different lengths never collide
        self.seen: dict[tuple[int, ...], list[int]] = {}
        self.matched = 0

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for m in range(self.shortest, min(self.n, end - 1) + 1):
                # the m-gram before the newest token now has a continuation
                starts = self.seen.setdefault(tuple(self.tokens[end - 1 - m : end - 1]), [])
                starts.append(end - 1)
                if len(starts) > _KEPT_OCCURRENCES:
                    del starts[0]

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens."""
        found = self.propose_many(k, 1)
        return found[0] if found else []

    def propose_many(self, k: int, m: int) -> list[list[int]]:
        """Up to ``m`` distinct continuations (up to ``k`` tokens each) of earlier occurrences of
        the last n tokens (or, with none, of the longest shorter match), latest occurrence first;
        with ``per_match``, at most ``per_match`` tokens per matched token."""
        self.matched = 0
        for length in range(min(self.n, len(self.tokens)), self.shortest - 1, -1):
            out: list[list[int]] = []
            cap = min(k, self.per_match * length) if self.per_match else k
            for start in reversed(self.seen.get(tuple(self.tokens[-length:]), ())):
                cont = self.tokens[start : start + cap]
                if cont not in out:
                    out.append(cont)
                    if len(out) == m:
                        break
            if out:
                self.matched = length
                return out
        return []
