"""Copy drafting (prompt lookup): propose what followed an earlier occurrence of the last n tokens."""

from __future__ import annotations


class NGramIndex:
    """Where each n-gram of the context last occurred, for copy drafting (prompt lookup)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end > self.n:  # the n-gram before the newest token now has a continuation
                self.last[tuple(self.tokens[end - 1 - self.n : end - 1])] = end - 1

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the last n tokens."""
        if len(self.tokens) < self.n:
            return []
        start = self.last.get(tuple(self.tokens[-self.n :]))
        if start is None:
            return []
        return self.tokens[start : start + k]
