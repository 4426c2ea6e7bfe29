"""Real runs for the search: the wall-clock objective and re-timing of the best drafts.

Both go through the timing harness (:mod:`selfspec.engine.harness`): warm-up,
autoregressive and each draft interleaved per prompt, medians over repetitions.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from selfspec.draft.path import DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.decoding import DecodeConfig, autoregressive
from selfspec.engine.harness import Runner, interleaved, median_of, paired_ratios, recording, speedups
from selfspec.engine.speculate import self_speculative
from selfspec.model.plan import SkipPlan
from selfspec.search.rounds import decode_config_of
from selfspec.search.study import Evaluation

AR = "autoregressive"


def plan_runner(model, eos_ids, plan: SkipPlan | None, cfg: DecodeConfig, draft: DraftPath | None = None) -> Runner:
    """A harness runner: self-speculative with ``plan`` (and ``draft``'s options), or autoregressive for ``None``."""

    def run(ids: list[int], max_new_tokens: int | None):
        c = cfg if max_new_tokens is None else replace(cfg, max_new_tokens=max_new_tokens)
        if plan is None:
            return autoregressive(model, ids, c, eos_ids)
        return self_speculative(model, ids, plan, c, eos_ids, draft=draft)

    return run


def spec_runner(model, eos_ids, spec: DraftSpec, base: DecodeConfig) -> Runner:
    """A harness runner for a whole draft: its skip plan, options and length policy."""
    path = DraftPath(model, spec.plan, spec.options, stop_ids=eos_ids)
    return plan_runner(model, eos_ids, spec.plan, decode_config_of(spec, base), draft=path)


def retime(model, prompts, specs: list[DraftSpec], eos_ids, max_new_tokens: int, reps: int,
           ar_tokens: list[list[int]] | None = None, progress: str | None = None) -> list[dict]:
    """AR and each draft on ``prompts``, interleaved after a warm-up; medians over ``reps``.

    ``speedup`` is end to end (tokens over total time, the prompt's prefill included);
    ``decode_speedup`` is over the time after each request's first token (TPOT), which is what
    the search predicts. Both are medians over repetitions of the ratio to AR *in the same
    repetition* (drift between repetitions cancels); ``decode_speedup_range`` is the lowest and
    highest of those ratios. ``ar_tokens``, if given, receives AR's tokens on each prompt (the full
    model's greedy continuations, which the search's prediction replays). ``progress``: the label
    of a progress bar of the runs (none when ``None``).
    """
    base = DecodeConfig(max_new_tokens=max_new_tokens, fallback=False)
    outputs: list[list[int]] = []
    runs = {AR: recording(plan_runner(model, eos_ids, None, base), outputs)}
    for i, spec in enumerate(specs):
        runs[f"draft{i}"] = spec_runner(model, eos_ids, spec, base)
    per_rep = interleaved(runs, prompts, reps, warmup_tokens=4, progress=progress)
    if ar_tokens is not None:
        ar_tokens[:] = outputs[: len(prompts)]  # the first repetition's, in prompt order
    speedup = speedups(per_rep, AR)
    ar_tps = median_of(per_rep[AR], "tokens_per_s")
    out = []
    for i in range(len(specs)):
        name = f"draft{i}"
        decode = paired_ratios(per_rep, name, AR, "tpot_s")
        out.append({"speedup": speedup[name], "decode_speedup": median(decode) if decode else float("nan"),
                    "decode_speedup_range": [min(decode), max(decode)] if decode else None,
                    "acceptance": median_of(per_rep[name], "acceptance_rate"),
                    "tokens_per_round": median_of(per_rep[name], "mean_accepted_length"),
                    "ar_tokens_per_s": ar_tps,
                    "tokens_per_s": median_of(per_rep[name], "tokens_per_s")})
    return out


class WallclockObjective:
    """Measured speedup of real self-speculative runs on the calibration prompts (noisy, slow)."""

    def __init__(self, model, prompts, eos_ids, max_new_tokens: int) -> None:
        self.model, self.prompts, self.eos = model, prompts, eos_ids
        self.base = DecodeConfig(max_new_tokens=max_new_tokens, fallback=False)
        ar = interleaved({AR: plan_runner(model, eos_ids, None, self.base)}, prompts, warmup_tokens=4)
        self.ar_tps = median_of(ar[AR], "tokens_per_s")

    def __call__(self, spec: DraftSpec) -> Evaluation:
        runs = interleaved({"draft": spec_runner(self.model, self.eos, spec, self.base)}, self.prompts, warmup_tokens=0)
        s = runs["draft"][0].summary()
        return Evaluation(s["tokens_per_s"] / self.ar_tps, s["acceptance_rate"], s["mean_accepted_length"])
