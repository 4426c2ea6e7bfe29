"""What the simulator counts and decides per round: the counts of rounds by drafted length (:class:`RoundCounts`),
a draft's remembered outputs (:class:`Drafted`), the key of a draft forward, and the small rules of a round (when
it is decided, a model round's accepted length) as the decoding loop applies them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

import torch

from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig
from selfspec.engine.speculate import AdaptiveThreshold
from selfspec.engine.tree import DraftTree


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
    def model_drafted(self) -> int:
        """Tokens the model drafted (draft steps), in chains and trees; copies not counted."""
        return sum(m * n for m, n in self.model_rounds.items()) + sum(m * n for (m, _), n in self.tree_rounds.items())

    @property
    def model_draft_rounds(self) -> int:
        """Rounds in which the model drafted at least one token (each has a first draft step)."""
        return sum(n for m, n in self.model_rounds.items() if m) + sum(n for (m, _), n in self.tree_rounds.items() if m)

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
    groups = max(o.group_for(o.weights), o.group_for(o.head_weights))
    key = spec.plan.attn, spec.plan.mlp, o.weights, groups, o.head_tokens, o.head_weights
    key += (o.int4_fit,) if o.int4 and o.int4_fit != "minmax" else ()
    key += (o.head_ids,) if o.head_ids != "lowest" else ()
    key += (("mlp_keep", round(o.mlp_keep, 3)),) if o.mlp_keep < 1.0 else ()
    return key + (("rescore", o.head_rescore),) if o.head_rescore else key


@dataclass(frozen=True)
class Drafted:
    """What a round needs of the draft's teacher-forced logits over ``c[i:i+n]``, per chunk position:
    the predicted token, its probability, the 2nd-best token and its probability."""

    pred: tuple[int, ...]
    conf: tuple[float, ...]
    second: tuple[int, ...]
    second_conf: tuple[float, ...] = ()

    def __len__(self) -> int:
        return len(self.pred)

    @classmethod
    def of(cls, logits: torch.Tensor) -> Drafted:
        """From the logits ``[n, V]`` of one round's chunk."""
        logits = logits.float()
        top = logits.topk(2, dim=-1)
        probs = (top.values - logits.logsumexp(-1, keepdim=True)).exp()
        return cls(tuple(top.indices[:, 0].tolist()), tuple(probs[:, 0].tolist()), tuple(top.indices[:, 1].tolist()),
                   tuple(probs[:, 1].tolist()))

    def extended(self, more: Drafted, at: int) -> Drafted:
        """These outputs up to position ``at``, then ``more`` (the positions from ``at`` on)."""
        return Drafted(self.pred[:at] + more.pred, self.conf[:at] + more.conf, self.second[:at] + more.second,
                       self.second_conf[:at] + more.second_conf)


def decided(out: Drafted, c: list[int], i: int, k: int, threshold: AdaptiveThreshold, lazy: bool) -> bool:
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


def model_round(out: Drafted, c: list[int], i: int, k: int, threshold: AdaptiveThreshold,
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
    accepted = leading_agreements(pred[:drafted], c[i + 1 : i + 1 + drafted])
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


def leading_agreements(draft: list[int], target: list[int]) -> int:
    n = 0
    for a, b in zip(draft, target):
        if a != b:
            break
        n += 1
    return n


def decode_config_of(spec: DraftSpec, base: DecodeConfig) -> DecodeConfig:
    """``base`` with the draft's length policy (k, adaptive exit, threshold)."""
    return replace(base, **spec.length)
