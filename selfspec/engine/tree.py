"""Draft trees: several candidate continuations, verified in one full-depth forward.

A :class:`DraftTree` is a trie of drafted tokens under the pending token (node
0, depth 0). Candidate paths go in best first; a path sharing a prefix with an
earlier one shares its nodes, so every node is a distinct continuation.

Layout on the one positional cache (:mod:`selfspec.engine.cache`): node ``i`` is
written at slot ``start + i`` and gets position id ``start + depth(i)``; each
node attends to every committed slot below ``start`` and to its own ancestors
(:func:`tree_attention_mask`). The first path inserted holds nodes ``1..d`` in
order, so when it wins no cache row moves; when another path wins, its rows
(at most the accepted path's, never the cache) are copied down to the committed
slots ``start+1..`` (:meth:`PositionalKVCache.move_rows`), and everything
else is dropped by the position rule, as for a chain.

Greedy acceptance (:meth:`DraftTree.accept_greedy`) follows the target's argmax
from the root while a child carries it: the accepted path is exactly the chain
AR would have produced, plus the target's next token.

Sampling acceptance (:meth:`DraftTree.accept_sampling`) is multi-candidate
rejection sampling (SpecInfer's, with point-mass proposals for deterministic
candidates): at each node the children are tried in insertion order against a
residual distribution ``r`` that starts as the target's ``p`` there. A child
drawn from the draft distribution ``q`` is accepted with probability
``min(1, r(x)/q(x))``, else ``r <- norm(max(0, r - q))`` (the chain's rule); a
deterministic child ``c`` (a copy, a 2nd-best token) is accepted with
probability ``r(c)``, else ``r(c) <- 0`` and ``r`` is renormalized. Each step
returns a token distributed as its input ``r`` (for the point mass, whatever
``c`` is), so the token after every accepted prefix is distributed as the
target's own. That needs the drawn child to be tried first at its node (its
siblings may be chosen knowing it, never the other way): :meth:`add_path`
keeps it so.
"""

from __future__ import annotations

import torch

from selfspec.engine.masks import layer_masks
from selfspec.engine.sampling import sample


class DraftTree:
    """A trie of drafted tokens below the pending token, with a node budget (the first path always whole)."""

    def __init__(self, root: int, budget: int) -> None:
        self.tokens = [int(root)]
        self.parent = [-1]
        self.depth = [0]
        self.source = [""]
        self.children: list[dict[int, int]] = [{}]
        self.proposal: list[torch.Tensor | None] = [None]  # q a node's token was drawn from; None: chosen
        self.budget = budget

    @property
    def drafted(self) -> int:
        """Drafted nodes (the root is the pending token, not a draft)."""
        return len(self.tokens) - 1

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def is_chain(self) -> bool:
        return all(len(c) <= 1 for c in self.children)

    def add_path(self, tokens: list[int], source: str, parent: int = 0,
                 proposals: list[torch.Tensor] | None = None) -> list[int]:
        """Insert ``tokens`` below ``parent``; returns the path's nodes (shorter where the budget ran out).

        The first path goes in whole, however long: the budget bounds what the later candidates add beside
        it, so a tree never verifies less of its best candidate than the chain would.
        ``proposals`` (sampling): the distribution each token was drawn from. A drawn token must be
        its parent's first child (see the module's docstring); chosen tokens may go anywhere.
        """
        whole = self.drafted == 0
        node, path = parent, []
        for i, t in enumerate(tokens):
            t = int(t)
            nxt = self.children[node].get(t)
            q = proposals[i] if proposals else None
            if nxt is None:
                if self.drafted >= self.budget and not whole:
                    break
                if q is not None and self.children[node]:
                    raise ValueError("a drawn token must be tried first at its node: insert drawn paths first")
                nxt = len(self.tokens)
                self.tokens.append(t)
                self.parent.append(node)
                self.depth.append(self.depth[node] + 1)
                self.source.append(source)
                self.children.append({})
                self.proposal.append(q)
                self.children[node][t] = nxt
            path.append(nxt)
            node = nxt
        return path

    def ancestors(self) -> torch.Tensor:
        """``[N, N]`` bool: ``[i, j]`` is true where node ``j`` is node ``i`` or one of its ancestors."""
        n = len(self.tokens)
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            j = i
            while j >= 0:
                anc[i, j] = True
                j = self.parent[j]
        return anc

    def accept_greedy(self, argmax: list[int]) -> tuple[list[int], int]:
        """The accepted nodes (root excluded) and the target's next token, from the per-node argmax."""
        node, path = 0, []
        while True:
            nxt = self.children[node].get(argmax[node])
            if nxt is None:
                return path, argmax[node]
            path.append(nxt)
            node = nxt

    def accept_sampling(self, p: torch.Tensor, generator: torch.Generator | None) -> tuple[list[int], int]:
        """The accepted nodes (root excluded) and the next token, from the target's per-node
        distributions ``p`` ``[N, V]``, by multi-candidate rejection sampling (module docstring)."""
        node, path = 0, []
        while True:
            r, chosen = p[node], None
            for child in self.children[node].values():  # insertion order: a drawn child first
                x, q = self.tokens[child], self.proposal[child]
                u = float(torch.rand((), generator=generator, device=r.device))
                if q is None:  # a chosen token: a point-mass proposal
                    if u < float(r[x]):
                        chosen = child
                        break
                    r = r.clone()
                    r[x] = 0.0
                else:  # u < r(x)/q(x), without dividing by zero
                    if u * float(q[x]) < float(r[x]):
                        chosen = child
                        break
                    r = (r - q).clamp_min(0.0)
                total = r.sum()
                if total <= 0:  # a rejection with probability 0 that rounding made possible
                    r = p[node]
                    break
                r = r / total
            if chosen is None:
                return path, int(sample(r, generator))
            path.append(chosen)
            node = chosen

    def accept_greedy_along(self, target: list[int]) -> list[int]:
        """The accepted nodes when the target's greedy continuation is ``target`` (the search's simulator):
        :meth:`accept_greedy` with the target's token at each node's depth."""
        return self.accept_greedy([target[d] if d < len(target) else -1 for d in self.depth])[0]

    def winner(self, path: list[int]) -> str:
        """Which candidate the accepted path came from (the source of its deepest node)."""
        return self.source[path[-1]] if path else "none"


def tree_attention_mask(model, tree: DraftTree, start: int, device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The verify forward's attention mask for ``tree`` written at slots ``start..``.

    ``[1, 1, N, start+N]``: every committed slot, then the node's ancestors
    (see :func:`selfspec.engine.masks.layer_masks` for sliding windows and dtypes).
    """
    n = len(tree.tokens)
    depth = torch.tensor(tree.depth, dtype=torch.long)
    allowed = torch.ones(n, start + n, dtype=torch.bool)
    allowed[:, start:] = tree.ancestors()
    return layer_masks(model, allowed, start + depth, torch.cat([torch.arange(start), start + depth]), device)
