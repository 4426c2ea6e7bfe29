"""Token ids ranked by how often a tokenizer emits them: the base of a ``head_ids: frequent`` cut head.

A cut draft head (``head_tokens: N``, :mod:`selfspec.draft.path`) scores N base
ids, the prompt's own ids and the stop ids. Its default base is the N lowest
ids, on the assumption that byte-pair merge order follows frequency.
``head_ids: frequent`` takes instead the ids this tokenizer emits most often in
the assistant turns of the last :data:`RANK_CONVERSATIONS` conversations of the
packaged ShareGPT file, then the lowest ids it never emitted. The task sets
read the first matching rows of that file, never these
(``tests/assets/test_vocab.py`` checks it).

The ranking is computed once per tokenizer (about 6 s on a 2-core CPU for the
Qwen2.5 tokenizer, which emits 50,788 distinct ids there) and cached as
``<cache>/vocab/<tokenizer hash>.json``.
:func:`attach` puts a :class:`TokenRank` on the model instance that
:func:`~selfspec.assets.models.load_model` returns, and :func:`rank_of` reads
it back, so every draft path of that model finds it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from selfspec.assets.data import packaged_rows_file
from selfspec.assets.fetch import default_cache_dir
from selfspec.errors import SelfSpecError

RANK_CONVERSATIONS = 3000  # the last ones of the packaged ShareGPT file: no task set reads them
_ATTR = "selfspec_token_rank"  # the model instance's attribute holding its TokenRank
_VERSION = 1  # bump when what is ranked changes: older cache files are then ignored


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    try:  # a Hugging Face tokenizer: one batched call, no BOS/EOS
        return list(tokenizer(texts, add_special_tokens=False)["input_ids"])
    except TypeError:  # a plain tokenizer (the tiny models' bytes): one text a call
        return [tokenizer(t)["input_ids"] for t in texts]


def rank_ids(tokenizer, texts: Iterable[str]) -> list[int]:
    """The ids ``tokenizer`` emits for ``texts``, most frequent first (ties: the lower id first)."""
    counts: Counter[int] = Counter()
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == 256:
            counts.update(i for ids in _encode(tokenizer, batch) for i in ids)
            batch = []
    if batch:
        counts.update(i for ids in _encode(tokenizer, batch) for i in ids)
    return [int(i) for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def assistant_turns(cache_dir: Path | None = None, conversations: int = RANK_CONVERSATIONS) -> list[str]:
    """The assistant turns of the last ``conversations`` conversations of the packaged ShareGPT file."""
    with open(packaged_rows_file("sharegpt", "long_conversation", cache_dir), encoding="utf-8") as f:
        rows = f.readlines()[-conversations:]
    return [t["value"] for line in rows for t in json.loads(line)["turns"] if t["from"] == "gpt" and t["value"]]


def tokenizer_hash(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (what the ranking depends on)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps([_VERSION, vocab], ensure_ascii=False).encode()).hexdigest()[:16]


class TokenRank:
    """One tokenizer's ids by frequency (:func:`rank_ids`), computed on first use.

    From ``texts`` where given (kept in memory); else from :func:`assistant_turns`, cached on disk under
    ``cache_dir`` (default: the project's cache)."""

    def __init__(self, tokenizer, cache_dir: str | Path | None = None, texts: Iterable[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else None
        self.texts = None if texts is None else list(texts)
        self._ids: torch.Tensor | None = None

    def path(self) -> Path:
        return (self.cache_dir or default_cache_dir()) / "vocab" / f"{tokenizer_hash(self.tokenizer)}.json"

    def __call__(self) -> torch.Tensor:
        """The ranked ids (a 1-D long tensor, most frequent first; ids never emitted are absent)."""
        if self._ids is None:
            self._ids = torch.tensor(self._load(), dtype=torch.long)
        return self._ids

    def _load(self) -> list[int]:
        if self.texts is not None:
            return rank_ids(self.tokenizer, self.texts)
        path = self.path()
        if path.is_file():
            try:
                return [int(i) for i in json.loads(path.read_text())["ids"]]
            except (ValueError, KeyError, TypeError):  # a damaged file: rank again and replace it
                pass
        ids = rank_ids(self.tokenizer, assistant_turns(self.cache_dir))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")  # a whole file or none: a second writer is harmless
        tmp.write_text(json.dumps({"source": f"sharegpt, assistant turns of the last {RANK_CONVERSATIONS} "
                                             "conversations", "ids": ids}))
        os.replace(tmp, path)
        return ids


def attach(model: torch.nn.Module, rank: TokenRank) -> None:
    """Give ``model`` (this instance) its tokenizer's ranking, for the draft paths built on it."""
    setattr(model, _ATTR, rank)


def has_rank(model: torch.nn.Module) -> bool:
    """Whether ``model`` carries its tokenizer's ranking (:func:`attach`), which ``head_ids: frequent`` needs."""
    return getattr(model, _ATTR, None) is not None


def rank_of(model: torch.nn.Module) -> torch.Tensor:
    """The ranked ids :func:`attach` gave ``model``; an error naming the fix where it has none."""
    rank = getattr(model, _ATTR, None)
    if rank is None:
        raise SelfSpecError("head_ids=frequent needs the tokenizer's token ranking: load the model with "
                            "selfspec.assets.models.load_model, or give it one with selfspec.assets.vocab.attach")
    return rank()


def frequent_base(rank: torch.Tensor, n: int, vocab: int) -> list[int]:
    """The ``n`` most frequent ids of ``rank`` below ``vocab``, then the lowest others up to ``n`` in all."""
    ids = [int(i) for i in rank.tolist() if 0 <= int(i) < vocab][:n]
    if len(ids) < n:
        seen = set(ids)
        ids += [i for i in range(vocab) if i not in seen][:n - len(ids)]
    return ids
