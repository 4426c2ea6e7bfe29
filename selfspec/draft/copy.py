"""Copy drafting (prompt lookup): propose what followed an earlier occurrence of the last n tokens."""

from __future__ import annotations

# earlier occurrences of one n-gram kept for multi-candidate copy drafting (the latest ones)
_KEPT_OCCURRENCES = 16


class NGramIndex:
    """Where each n-gram of the context occurred (the latest few times), for copy drafting."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end > self.n:  # the n-gram before the newest token now has a continuation
                starts = self.seen.setdefault(tuple(self.tokens[end - 1 - self.n : end - 1]), [])
                starts.append(end - 1)
                if len(starts) > _KEPT_OCCURRENCES:
                    del starts[0]

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens."""
        found = self.propose_many(k, 1)
        return found[0] if found else []

    def propose_many(self, k: int, m: int) -> list[list[int]]:
        """Up to ``m`` distinct continuations (up to ``k`` tokens each) of earlier occurrences of
        the last n tokens, latest occurrence first."""
        if len(self.tokens) < self.n:
            return []
        out: list[list[int]] = []
        for start in reversed(self.seen.get(tuple(self.tokens[-self.n :]), ())):
            cont = self.tokens[start : start + k]
            if cont not in out:
                out.append(cont)
                if len(out) == m:
                    break
        return out
