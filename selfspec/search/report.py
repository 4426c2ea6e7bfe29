"""The search's report: what it found, predicted and measured, and where its time went."""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field

from selfspec.draft.spec import DraftSpec
from selfspec.search.costs import verify_overhead, weight_format


@dataclass
class SearchReport:
    draft: DraftSpec
    predicted_speedup: float
    calibration: dict  # acceptance / tokens per round / speedup, predicted and measured
    heldout: dict
    trials: int
    search_seconds: float
    plan_path: str
    cost_model_note: str
    candidates: list = field(default_factory=list)
    ablation: list = field(default_factory=list)
    stages: dict = field(default_factory=dict)  # seconds of each stage of the search, in order
    draft_chunks: dict = field(default_factory=dict)  # this process: draft chunks run / answered from memory
    setup_seconds: float = 0.0  # before the search's clock: fetching and loading the model and prompts (the entry point's)
    time_target_s: float | None = None  # SearchSettings.time_target_s
    plain_step_s: float | None = None  # the cost model's one-token full-model forward on this machine
    trimmed: list = field(default_factory=list)  # what the final stages left out to meet time_target_s (fit_target)
    final_stages_s: list | None = None  # the final stages' estimated seconds as run, and the seconds left for them
    loop_overheads: dict = field(default_factory=dict)  # the cost model's overheads (CostModel.overhead), seconds
    unsaved: str | None = None  # why the draft file could not be written (plan_path is then empty)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["draft"] = self.draft.to_dict()
        return d


def measured_part(m: dict) -> dict:
    return {k: m[k] for k in ("acceptance", "tokens_per_round", "decode_speedup", "decode_speedup_range", "speedup")
            if k in m}


def _spread(lo_hi: list[float] | None) -> str:
    """The measured decode speedup's range over the repetitions, as printed after it."""
    return f" ({lo_hi[0]:.2f}-{lo_hi[1]:.2f}x over the repetitions)" if lo_hi and lo_hi[0] != lo_hi[1] else ""


def format_report(r: SearchReport) -> str:
    def row(label: str, d: dict) -> str:
        p, m = d.get("predicted") or {}, d.get("measured") or {}
        if not p:
            return f"{label:<12}-"
        return (f"{label:<12}acceptance {p['acceptance']:.3f} predicted / {m['acceptance']:.3f} measured; "
                f"tokens per round {p['tokens_per_round']:.2f} / {m['tokens_per_round']:.2f}; "
                f"decode speedup {p['decode_speedup']:.2f}x / {m['decode_speedup']:.2f}x"
                f"{_spread(m.get('decode_speedup_range'))} "
                f"(end to end, prefill included: {m['speedup']:.2f}x)")

    lines = ["", f"best draft  {r.draft.describe()}", row("calibration", r.calibration), row("held-out", r.heldout),
             f"trials      {r.trials}; {r.cost_model_note}",
             f"time        {r.search_seconds:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in r.stages.items())
             + (f"; {r.setup_seconds:.0f} s before it (prompts and model fetched and loaded, kernel built)"
                if r.setup_seconds else ""),
             *([f"chunks      {r.draft_chunks['run']} teacher-forced draft chunks run on the calibration prompts by "
                f"this process, {r.draft_chunks['reused']} answered from memory (earlier trials, same draft forward)"]
               if r.draft_chunks else []),
             "re-timed candidates:"]
    for c in r.candidates:
        timed = c.get("predicted_timed_speedup")  # reports written before it have only the trials' prediction
        on_timed = f", {timed:.2f}x on the timed prompts" if timed is not None else ""
        lines.append(f"  {c['draft']}: decode speedup predicted {c['predicted_speedup']:.2f}x (all calibration "
                     f"prompts){on_timed}, measured {c['measured_decode_speedup']:.2f}x"
                     f"{_spread(c.get('measured_decode_speedup_range'))} "
                     f"(end to end {c['measured_speedup']:.2f}x)")
        if c.get("twins"):
            lines.append(f"    and {len(c['twins'])} more with the same predicted rounds, not re-timed: "
                         + "; ".join(c["twins"][:3]) + ("; ..." if len(c["twins"]) > 3 else ""))
    if r.ablation:
        lines.append("ablation (re-timed calibration prompts; decode speedup predicted / measured, end to end, "
                     "acceptance predicted / measured):")
        for a in r.ablation:
            p, m = a["predicted"], a["measured"]
            spread = _spread(m.get("decode_speedup_range"))
            lines.append(f"  {a['variant']:<28} {p['decode_speedup']:.2f}x / {m['decode_speedup']:.2f}x{spread}, "
                         f"{m['speedup']:.2f}x, acceptance {p['acceptance']:.2f} / {m['acceptance']:.2f}")
    lines.append(f"draft written to {r.plan_path}" if not r.unsaved else f"draft not written: {r.unsaved}")
    held = (r.heldout.get("measured") or {}).get("speedup")  # end to end: what a user waits for
    if held is not None and held < 1.0:
        lines.append("note: no real speedup on held-out prompts for this model on this machine (see README).")
    if r.trimmed:
        lines.append(f"note: to finish within the {r.time_target_s:.0f} s target (search.time_target_s), "
                     + ", ".join(r.trimmed) + "; search.fit_target=false runs them as set.")
    lines += [note for note in (prediction_gap(r), heldout_gap(r), time_over(r)) if note]
    return "\n".join(lines)


def time_over(r: SearchReport) -> str | None:
    """A plain line on where the time went, if the run took longer than its target."""
    total = r.setup_seconds + r.search_seconds
    if r.time_target_s is None or total <= r.time_target_s:
        return None
    parts = {**({"fetching and loading": r.setup_seconds} if r.setup_seconds else {}), **r.stages}
    longest = sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    machine = (r.draft.plan.provenance or {}).get("machine") or {}
    where = ", ".join(str(machine[k]) for k in ("cpu", "isa") if machine.get(k))
    cores = f", {machine['cores']} cores" if machine.get("cores") else ""
    step = (f", where one full-model step of this model took {r.plain_step_s * 1e3:.0f} ms"
            if r.plain_step_s else "")
    shorter = ["search.ablation=false (no ablation)"] if "ablation" in r.stages else []  # not where it ran none
    shorter += ["search.heldout.reps=1", "search.retime.top_n=1", "fewer search.n_trials"]
    return (f"note: {total:.0f} s in all, over the {r.time_target_s:.0f} s target (search.time_target_s) by "
            f"{total - r.time_target_s:.0f} s. The search times real decoding on this CPU ({where or 'unknown'}{cores})"
            f"{step}; its longest parts: " + ", ".join(f"{k} {v:.0f} s" for k, v in longest) + ". Shorter, at the "
            "cost of what they measure: " + ", ".join(shorter) + ".")


def prediction_gap(r: SearchReport, margin: float = 0.85) -> str | None:
    """A plain line on why the chosen draft ran well below its prediction on the re-timed prompts, if it did
    while its acceptance was as predicted (the cost model's side, not the simulation's)."""
    p, m = r.calibration.get("predicted") or {}, r.calibration.get("measured") or {}
    if not p or not m or m["decode_speedup"] >= margin * p["decode_speedup"]:
        return None
    if abs(p["acceptance"] - m["acceptance"]) > 0.05:
        return None  # the rounds differ: heldout_gap's kind of note, not the cost model's
    o = r.loop_overheads
    verify = verify_overhead(o, weight_format(r.draft.options))  # after this draft's steps
    overheads = (f" (here {verify * 1e3:+.1f} ms a verify, {o['draft_step'] * 1e3:+.1f} ms a draft step)"
                 if verify is not None and "draft_step" in o else "")
    return (f"note: the chosen draft ran at {m['decode_speedup']:.2f}x against {p['decode_speedup']:.2f}x predicted on the "
            f"same prompts and tokens, with acceptance as predicted ({m['acceptance']:.2f} / {p['acceptance']:.2f}): the "
            "cost model priced its rounds too cheap, so the re-timing's measurement chose the draft. Its noisiest part "
            f"is what the decoding loop adds to each forward{overheads}, from a few short runs on a machine whose speed "
            "may drift; `selfspec-inspect round-costs <study storage> --remeasure` prices the same rounds with a cost "
            "model measured now (docs/log.md).")


def heldout_gap(r: SearchReport, margin: float = 0.9) -> str | None:
    """A plain line on why the held-out prompts ran well below the re-timed ones, if they did."""
    cal, held = r.calibration.get("measured") or {}, r.heldout.get("measured") or {}
    if not cal or not held or held["decode_speedup"] >= margin * cal["decode_speedup"]:
        return None
    why = ("the draft agreed with the model less often there" if held["acceptance"] < cal["acceptance"] - 0.05
           else "at about the same acceptance, so the rounds there cost more (shorter copies, other lengths)")
    return (f"note: held-out prompts ran at {held['decode_speedup']:.2f}x against {cal['decode_speedup']:.2f}x on the "
            f"re-timed ones: acceptance {held['acceptance']:.2f} against {cal['acceptance']:.2f}, tokens per round "
            f"{held['tokens_per_round']:.2f} against {cal['tokens_per_round']:.2f}; {why}. Calibration prompts "
            "closer to what you will run (dataset=<yours>) make the search pick for them.")


def stage(what: str) -> None:
    """Say on stderr which stage of the search starts."""
    print(f"[selfspec] {what}", file=sys.stderr, flush=True)
