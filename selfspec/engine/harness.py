"""The one timing harness: warm-up, interleaved order, medians.

Every comparison of decoding methods (the evaluation runner, the search's
re-timing, ``python -m selfspec.generate`` and the measurement scripts) runs
its methods through these few functions, so that each method pays its
first-call costs before timing starts, no method always runs first, and a
drifting machine hits every method alike. Tokens and time come from the
methods' own :class:`~selfspec.engine.stats.DecodeStats`; rates come from
:meth:`DecodeStats.summary`.

A *runner* is ``run(prompt_ids, max_new_tokens) -> Generation`` (``None`` =
its configured length), e.g. :meth:`selfspec.eval.methods.Method.generate`.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from tqdm.auto import tqdm

from selfspec.engine.decoding import Generation
from selfspec.engine.stats import DecodeStats

T = TypeVar("T")
Runner = Callable[[list[int], "int | None"], Generation]


def rotated(items: Sequence[T], i: int) -> list[T]:
    """``items`` starting at position ``i`` (modulo its length): the order of the i-th turn."""
    if not items:
        return []
    i %= len(items)
    return list(items[i:]) + list(items[:i])


def warm_up(runs: Mapping[str, Runner], prompt: list[int], tokens: int) -> None:
    """One short run of each method: allocation, kernel selection and lazy packing happen here, untimed."""
    for run in runs.values():
        run(prompt, tokens)


def recording(run: Runner, outputs: list[list[int]]) -> Runner:
    """``run``, also appending the tokens of every full-length (not warm-up) call to ``outputs``."""

    def rec(ids: list[int], max_new_tokens: int | None) -> Generation:
        gen = run(ids, max_new_tokens)
        if max_new_tokens is None:
            outputs.append(gen.tokens)
        return gen

    return rec


def interleaved(runs: Mapping[str, Runner], prompts: Sequence[list[int]], reps: int = 1,
                warmup_tokens: int = 8, max_new_tokens: int | None = None,
                progress: str | None = None) -> dict[str, list[DecodeStats]]:
    """Run every method on every prompt ``reps`` times after a warm-up, the order rotating each time.

    Returns, per method, one :class:`DecodeStats` per repetition (that repetition's prompts merged).
    ``progress``: a progress bar of the timed runs on stderr, with this label (none when ``None``).
    """
    if reps < 1 or not prompts:
        raise ValueError("interleaved needs at least one repetition and one prompt")
    names = list(runs)
    if warmup_tokens > 0:
        warm_up(runs, prompts[0], warmup_tokens)
    per_rep: dict[str, list[DecodeStats]] = {name: [] for name in names}
    turn = 0
    with tqdm(total=reps * len(prompts) * len(names), desc=progress, unit="run", file=sys.stderr,
              disable=progress is None) as bar:
        for _ in range(reps):
            parts: dict[str, list[DecodeStats]] = {name: [] for name in names}
            for ids in prompts:
                for name in rotated(names, turn):
                    parts[name].append(runs[name](ids, max_new_tokens).stats)
                    bar.update()
                turn += 1
            for name in names:
                per_rep[name].append(DecodeStats.merged(parts[name]))
    return per_rep


def median_of(reps: Sequence[DecodeStats], key: str) -> float:
    """The median over repetitions of one derived rate (``tokens_per_s``, ``acceptance_rate``, ...)."""
    values = [r.summary()[key] for r in reps]
    values = [v for v in values if v == v]  # rates undefined for a repetition (nan) do not count
    return statistics.median(values) if values else float("nan")


def paired_ratios(per_rep: Mapping[str, Sequence[DecodeStats]], name: str, baseline: str,
                  key: str = "tokens_per_s") -> list[float]:
    """Per repetition, ``name``'s rate over ``baseline``'s in that same repetition (for ``tpot_s``, a
    time, the baseline's over ``name``'s): a speedup each, paired so that drift between repetitions
    cancels."""
    out = []
    for mine, base in zip(per_rep[name], per_rep[baseline]):
        a, b = mine.summary()[key], base.summary()[key]
        r = b / a if key == "tpot_s" else a / b
        if r == r:
            out.append(r)
    return out


def speedups(per_rep: Mapping[str, Sequence[DecodeStats]], baseline: str) -> dict[str, float]:
    """Each method's speedup over the baseline: the median over repetitions of the paired tokens/s ratios."""
    return {name: statistics.median(paired_ratios(per_rep, name, baseline) or [float("nan")]) for name in per_rep}
