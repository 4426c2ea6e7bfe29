"""Replay copy-drafting rules over a run's recorded AR outputs, priced by a search's cost model.

    python scripts/copy_replay.py results/runs/main_avx2_search2 \
        --study results/optuna/qwen2.5-coder-1.5b-tasks-avx2-v2.db --rule latest:2:0:5 --rule earliest:2:1:5 ...

A rule is ``kind:n:m:length``: copy what followed an earlier occurrence of the longest match of the
last n .. m tokens (m = 0: n only), up to ``length`` tokens; ``latest`` takes the latest occurrence (our
:class:`~selfspec.draft.copy.NGramIndex`), ``earliest`` the first (transformers' prompt lookup). A round
with no match is a plain step. Greedy copy rounds are replayed exactly against the AR output: a
copy is accepted up to its first token that differs, plus the verify's own token.

Each round is priced by the study's cost model (``t_verify[rows] / t_full``, a plain step = 1; the
loop overheads are left out), and a row's predicted speedup is its new tokens over that time.
Approximate where it says so: the AR outputs are re-tokenized from their recorded text (a run
records text, not ids). Exploration only: a rule's settings are chosen by the search on
calibration rows, never by this replay of eval rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from selfspec.assets.data import load_task_set
from selfspec.assets.models import converted_dir, encode_chat
from selfspec.cli.config import group_option
from selfspec.draft.copy import NGramIndex
from selfspec.eval.records import read_jsonl
from selfspec.search.pipeline import study_calibration


def ar_outputs(run: Path, tokenizer) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Per task set: (prompt ids, AR output ids) of every turn the run's AR decoded (its first pass)."""
    out = {}
    for path in sorted(run.glob("*/*/samples.jsonl")):
        header, rows = read_jsonl(path)
        name = header["dataset"]
        samples = {s.id: s for s in load_task_set(group_option("dataset", name)).eval}
        turns = []
        for r in rows:
            if r.get("type", "sample") != "sample" or r["method"] != "autoregressive" or str(r.get("rep", 0)) != "0":
                continue
            texts = r["output_text"] if isinstance(r["output_text"], list) else json.loads(r["output_text"])
            messages: list[dict] = []
            for turn, text in zip(samples[r["sample_id"]].turns, texts):
                messages.append({"role": "user", "content": turn})
                turns.append((encode_chat(tokenizer, messages), tokenizer(text, add_special_tokens=False)["input_ids"]))
                messages.append({"role": "assistant", "content": text})
        out[name] = turns
    return out


def _earliest(ctx: list[int], n: int, m: int, length: int) -> list[int]:
    for size in range(min(n, len(ctx) - 1), m - 1, -1):
        gram = ctx[-size:]
        for s in range(len(ctx) - size):
            if ctx[s : s + size] == gram:
                return ctx[s + size : s + size + length]
    return []


def replay(prompt: list[int], output: list[int], rule: tuple[str, int, int, int], relative: dict[int, float]) -> float:
    """Predicted speedup over AR of one output under one copy rule."""
    kind, n, m, length = rule
    index = NGramIndex(n, m or None) if kind == "latest" else None
    ctx = prompt + output[:1]  # the first token comes from the prefill
    if index is not None:
        index.extend(ctx)
    i, time = 1, 0.0
    while i < len(output):
        cap = min(length, len(output) - i)  # no draft past the output's end
        draft = index.propose(cap) if index is not None else _earliest(ctx, n, m or n, cap)
        if not draft:
            time, take = time + 1.0, 1
        else:
            accepted = 0
            while accepted < len(draft) and draft[accepted] == output[i + accepted]:
                accepted += 1
            time, take = time + relative[len(draft) + 1], min(accepted + 1, len(output) - i)
        new = output[i : i + take]
        ctx += new
        if index is not None:
            index.extend(new)
        i += take
    return (len(output) - 1) / time if time else 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a run folder (results/runs/<name>) whose methods include autoregressive")
    ap.add_argument("--study", type=Path, required=True, help="a search's study .db: its cost model prices the rounds")
    ap.add_argument("--study-name", help="default: the .db file's stem")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b", help="whose tokenizer re-tokenizes the outputs")
    ap.add_argument("--rule", action="append", required=True, help="kind:n:m:length, e.g. latest:8:2:5 (repeatable)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    costs = study_calibration(f"sqlite:///{args.study}", args.study_name or args.study.stem)["costs"]
    relative = {int(r): t / costs["t_full"] for r, t in costs["t_verify"].items()}
    rules = []
    for text in args.rule:
        kind, *nums = text.split(":")
        if kind not in ("latest", "earliest") or len(nums) != 3:
            raise SystemExit(f"--rule {text!r}: expected latest|earliest:n:m:length")
        rules.append((kind, *map(int, nums)))
    if max(r[3] for r in rules) + 1 > max(relative):
        raise SystemExit(f"the cost model times verifies of up to {max(relative)} rows")
    data = ar_outputs(args.run, AutoTokenizer.from_pretrained(converted_dir(args.model)))
    sets = list(data)
    print(f"machine of the cost model: {costs.get('machine')}; AR turns per set: "
          + ", ".join(f"{s} {len(data[s])}" for s in sets))
    tasks = [i for i, s in enumerate(sets) if s != "unseen"]  # the four task sets the search calibrates on
    print("| rule | " + " | ".join(sets) + " | mean of the task sets |")
    print("|---" * (len(sets) + 2) + "|")
    for rule in rules:
        means = [statistics.mean(replay(p, o, rule, relative) for p, o in data[s]) for s in sets]
        print(f"| {':'.join(map(str, rule))} | " + " | ".join(f"{x:.2f}x" for x in means)
              + f" | {statistics.mean(means[i] for i in tasks):.2f}x |")


if __name__ == "__main__":
    main()
