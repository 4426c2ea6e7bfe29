"""Real runs for the search: the wall-clock objective and re-timing of the best plans.

Both go through the timing harness (:mod:`selfspec.eval.harness`): warm-up,
autoregressive and each plan interleaved per prompt, medians over repetitions.
"""

from __future__ import annotations

from dataclasses import replace

from selfspec.draft.path import DraftPath
from selfspec.draft.plan import SkipPlan
from selfspec.engine.decoding import DecodeConfig, autoregressive, self_speculative
from selfspec.eval.harness import Runner, interleaved, median_of, speedups
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


def retime(model, prompts, plans_k: list[tuple[SkipPlan, int]], eos_ids, max_new_tokens: int, reps: int) -> list[dict]:
    """AR and each (plan, k) on ``prompts``, interleaved after a warm-up; medians over ``reps``."""
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, fallback=False)
    runs = {AR: plan_runner(model, eos_ids, None, cfg)}
    for i, (plan, k) in enumerate(plans_k):
        runs[f"plan{i}"] = plan_runner(model, eos_ids, plan, replace(cfg, k=k))
    per_rep = interleaved(runs, prompts, reps, warmup_tokens=4)
    speedup = speedups(per_rep, AR)
    ar_tps = median_of(per_rep[AR], "tokens_per_s")
    return [
        {"speedup": speedup[f"plan{i}"], "acceptance": median_of(per_rep[f"plan{i}"], "acceptance_rate"),
         "ar_tokens_per_s": ar_tps, "tokens_per_s": median_of(per_rep[f"plan{i}"], "tokens_per_s")}
        for i in range(len(plans_k))
    ]


class WallclockObjective:
    """Measured speedup of real self-speculative runs on the calibration prompts (noisy, slow)."""

    def __init__(self, model, prompts, eos_ids, max_new_tokens: int, k: int) -> None:
        self.model, self.prompts, self.eos = model, prompts, eos_ids
        self.cfg = DecodeConfig(max_new_tokens=max_new_tokens, k=k, fallback=False)
        ar = interleaved({AR: plan_runner(model, eos_ids, None, self.cfg)}, prompts, warmup_tokens=4)
        self.ar_tps = median_of(ar[AR], "tokens_per_s")

    def __call__(self, plan: SkipPlan) -> Evaluation:
        runs = interleaved({"plan": plan_runner(self.model, self.eos, plan, self.cfg)}, self.prompts, warmup_tokens=0)
        stats = runs["plan"][0].summary()
        return Evaluation(stats["tokens_per_s"] / self.ar_tps, self.cfg.k, float("nan"), stats["acceptance_rate"])
