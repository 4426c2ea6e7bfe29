"""The search's typed settings, and how its final stages fit the time left (no Hydra here)."""

from __future__ import annotations

from dataclasses import dataclass, field

from selfspec.engine.decoding import DecodeConfig
from selfspec.errors import SelfSpecError
from selfspec.search.space import DraftDims, SearchSpace
from selfspec.search.workers import Liveness


@dataclass(frozen=True)
class RetimeSettings:
    top_n: int = 3
    reps: int = 2
    prompts: int = 4
    max_new_tokens: int = 32

    def __post_init__(self) -> None:
        _at_least(self, 1, "retime", "top_n", "reps", "prompts", "max_new_tokens")


@dataclass(frozen=True)
class HeldoutSettings:
    prompts: int = 4
    max_new_tokens: int = DecodeConfig.max_new_tokens  # as long as an evaluation's answers
    reps: int = 2

    def __post_init__(self) -> None:
        _at_least(self, 0, "heldout", "prompts")
        _at_least(self, 1, "heldout", "max_new_tokens", "reps")


def _at_least(settings, lowest: int, where: str, *names: str) -> None:
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise SelfSpecError(f"{where}.{name} must be an integer >= {lowest}, got {value!r}")


@dataclass(frozen=True)
class SearchSettings:
    n_trials: int = 100
    sampler: str = "tpe"
    objective: str = "predicted"
    calibration_tokens: int = 24
    # the skip range's defaults are the search space's own (SearchSpace)
    min_skipped: int = SearchSpace.min_skipped
    max_skipped: int | None = SearchSpace.max_skipped
    protect_first_last: bool = SearchSpace.protect_first_last
    space: DraftDims = field(default_factory=DraftDims)
    warm_start: tuple[str, ...] = ()
    anchors: bool = True
    storage: str = "outputs/optuna/search.db"
    study_name: str = "search"
    liveness: Liveness = field(default_factory=Liveness)
    cost_reps: int = 7
    batch: int = 4
    prune: bool = True
    ablation: bool = True
    seed: int = 0
    plans_dir: str = "outputs/plans"
    retime: RetimeSettings = field(default_factory=RetimeSettings)
    heldout: HeldoutSettings = field(default_factory=HeldoutSettings)
    time_target_s: float | None = 600.0  # the report says where the time went when a run takes longer (None: no check)
    fit_target: bool = True  # trim the final stages' repetitions when that keeps the run within time_target_s

    def __post_init__(self) -> None:
        if self.objective not in ("predicted", "wallclock"):
            raise SelfSpecError(f"unknown objective {self.objective!r}; choose predicted or wallclock")
        _at_least(self, 1, "search", "n_trials", "cost_reps", "batch")
        _at_least(self, 2, "search", "calibration_tokens")


@dataclass(frozen=True)
class FinalStages:
    """The repetitions the held-out check and the ablation run (0: the ablation does not run), and what was
    left out of the settings to meet the time target."""
    heldout_reps: int
    ablation_reps: int
    trimmed: tuple[str, ...] = ()
    estimate_s: float | None = None  # their estimated seconds, as run (None: no target to fit)


def fit_final_stages(s: SearchSettings, left_s: float | None, run_s: float, n_held: int, n_timed: int,
                     n_variants: int, margin: float = 1.1) -> FinalStages:
    """The final stages as set, or with fewer repetitions where ``left_s`` (seconds left before
    ``s.time_target_s``; None: no target) would not hold them and fewer would (``s.fit_target``).

    Estimated from ``run_s``, one re-timing run's seconds (``s.retime.max_new_tokens`` tokens): the held-out
    check runs AR and the draft ``heldout.reps`` times on ``n_held`` prompts of ``heldout.max_new_tokens``
    tokens, the ablation AR and ``n_variants`` drafts on the ``n_timed`` re-timing prompts. Trimmed in order:
    the ablation to one repetition, the held-out check to one, then no ablation; the held-out check always runs.
    When even that would not fit, everything runs as set (the report's time note then says why). ``margin``:
    the estimate times this must fit (the main job's held-out check ran ~15% over it, docs/log.md).
    """
    held, ablation = s.heldout.reps, (s.retime.reps if s.ablation and n_variants else 0)
    per_held = 2 * n_held * run_s * s.heldout.max_new_tokens / s.retime.max_new_tokens
    per_ablation = (1 + n_variants) * n_timed * run_s

    def estimate(h: int, a: int) -> float:
        return margin * (h * per_held + a * per_ablation)

    def fits(h: int, a: int) -> bool:
        return estimate(h, a) <= left_s

    if left_s is None:
        return FinalStages(held, ablation)
    if not s.fit_target or fits(held, ablation):
        return FinalStages(held, ablation, estimate_s=estimate(held, ablation))
    trims = [(held, min(ablation, 1)), (min(held, 1), min(ablation, 1)), (min(held, 1), 0)]
    for h, a in trims:
        if fits(h, a):
            said = []
            if a < ablation:
                said.append(f"the ablation ran {a} repetition (not {ablation})" if a else "the ablation did not run")
            if h < held:
                said.append(f"the held-out check ran {h} repetition (not {held})")
            return FinalStages(h, a, tuple(said), estimate(h, a))
    return FinalStages(held, ablation, estimate_s=estimate(held, ablation))
