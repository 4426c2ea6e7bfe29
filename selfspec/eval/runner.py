"""Evaluation: decode every sample of a task set with several methods, one JSONL row each.

Rows and the header are those of :mod:`selfspec.eval.records`. All methods
run in the same process on the same prompts, after a warm-up; within a
sample the method order rotates so no method always runs first.

Resume: rerunning into an existing file checks the fingerprint, skips
samples whose rows are all present and appends the rest. A sample's rows are
written together once all its methods are done, so a kill loses at most the
sample in progress.

Repetitions (``reps``): the whole list of samples is decoded ``reps`` times,
one pass after the other, the method order rotating on, so that a drifting
machine hits every method alike and the first and the last pass of the
baseline tell the run's own drift. Rows carry their pass as ``rep``; a run
extended to more repetitions resumes with the passes it lacks.
"""

from __future__ import annotations

import json
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from selfspec.assets.data import Sample, TaskSet
from selfspec.assets.models import LoadedModel, encode_chat
from selfspec.engine.decoding import Generation, context_length
from selfspec.engine.harness import rotated, warm_up
from selfspec.engine.stats import DecodeStats
from selfspec.errors import RunRefused, SelfSpecError
from selfspec.eval.methods import Method
from selfspec.eval.records import (
    decode_record,
    read_jsonl,
    repair_torn_tail,
    sample_row,
    skipped_samples,
)
from selfspec.locks import exclusive
from selfspec.provenance import append_lines, strict_json


@dataclass(frozen=True)
class EvalSettings:
    out_path: Path
    baseline: str = "autoregressive"
    n_samples: int | None = None  # first n eval samples; None = all
    warmup_tokens: int = 16
    reps: int = 1  # passes over the samples, interleaved (see the module's docstring)

    def __post_init__(self) -> None:
        _integer("reps", self.reps, 1)
        if self.n_samples is not None:
            _integer("n_samples", self.n_samples, 1, " (or null for all)")
        _integer("warmup_tokens", self.warmup_tokens, 0)


def _integer(name: str, value, lowest: int, note: str = "") -> None:
    """Refuse anything but an integer >= ``lowest`` (a string, a float, a bool) in one line naming the setting."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise SelfSpecError(f"{name} must be an integer >= {lowest}{note}, got {value!r}")


def run_sample(method: Method, lm: LoadedModel, sample: Sample) -> tuple[Generation, list[str]]:
    """Decode all turns of ``sample``; later turns follow the method's own earlier answers."""
    messages: list[dict] = []
    gens: list[Generation] = []
    texts: list[str] = []
    tokens: list[int] = []
    for turn in sample.turns:
        messages.append({"role": "user", "content": turn})
        gen = method.generate(encode_chat(lm.tokenizer, messages))
        text = lm.tokenizer.decode([t for t in gen.tokens if t not in lm.eos_ids], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": text})
        gens.append(gen)
        texts.append(text)
        tokens.extend(gen.tokens)
    return Generation(tokens, DecodeStats.merged([g.stats for g in gens])), texts


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def evaluate(lm: LoadedModel, tasks: TaskSet, methods: list[Method], settings: EvalSettings, header: dict,
             on_sample: Callable[[list[dict]], None] | None = None,
             on_accepted: Callable[[], None] | None = None) -> list[dict]:
    """Run every method on every eval sample (resuming a partial file); returns all rows.

    ``on_accepted`` is called once the run folder has been accepted (new, or holding rows of
    these very settings) and before anything is decoded or written; a folder refused
    (:class:`~selfspec.errors.RunRefused`) is left untouched.
    """
    if not methods:
        raise SelfSpecError("no methods to evaluate")
    names = [m.name for m in methods]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise SelfSpecError(f"methods lists {', '.join(twice)} more than once; list each method once")
    if methods[0].cfg.max_new_tokens < 1:
        raise SelfSpecError(f"an evaluation run needs max_new_tokens >= 1, got {methods[0].cfg.max_new_tokens}")
    if settings.baseline not in names:
        raise SelfSpecError(f"the baseline {settings.baseline!r} is not among the methods {names}")
    samples = list(tasks.eval[: settings.n_samples])
    if not samples:
        raise SelfSpecError(f"dataset {tasks.name!r} has no eval samples")
    fingerprint = {
        "model": lm.name, "dtype": lm.info.get("dtype"), "dataset": tasks.name,
        "max_new_tokens": methods[0].cfg.max_new_tokens, "methods": names,
        "decode": {m.name: decode_record(m.cfg) for m in methods},
        "plans": {m.name: {"num_layers": m.plan.num_layers, "attn": m.plan.attn, "mlp": m.plan.mlp}
                  for m in methods if m.plan is not None},
        "method_info": {m.name: m.info for m in methods if m.info},
    }
    fingerprint = json.loads(json.dumps(fingerprint))  # the form it has when read back
    path = settings.out_path
    with exclusive(path, f"the run folder {path.parent}"):
        return _write_rows(lm, tasks, methods, settings, header, on_sample, on_accepted, fingerprint)


def _write_rows(lm: LoadedModel, tasks: TaskSet, methods: list[Method], settings: EvalSettings, header: dict,
                on_sample, on_accepted, fingerprint: dict) -> list[dict]:
    """The body of :func:`evaluate`, run while its lock on the results file is held."""
    path, names = settings.out_path, [m.name for m in methods]
    samples = list(tasks.eval[: settings.n_samples])
    # a write stopped midway (a kill, a full disk) leaves a partial line, or a sample's first rows without the
    # rest: cut them off before reading, so the sample is decoded again and its rows are never there twice
    repair_torn_tail(path, names)
    old_header, rows = read_jsonl(path)
    if old_header is not None and old_header.get("fingerprint") != fingerprint:
        raise RunRefused(
            f"{path} holds results of another setting (model, dataset, methods, decoding or plan differ); "
            "choose another output folder or delete the file to start over"
        )
    done: dict[tuple[int, str], set[str]] = {}
    for r in rows:
        done.setdefault((r.get("rep", 0), r["sample_id"]), set()).add(r["method"])
    skipped = skipped_samples(path)
    todo = [(rep, s) for rep in range(settings.reps) for s in samples
            if not set(names) <= done.get((rep, s.id), set()) and s.id not in skipped]
    path.parent.mkdir(parents=True, exist_ok=True)
    if on_accepted:
        on_accepted()
    if old_header is None:
        head = {"type": "header", "fingerprint": fingerprint, "baseline": settings.baseline,
                "extra_memory_bytes": {m.name: m.extra_memory_bytes for m in methods}, **header}
        path.write_text(json.dumps(strict_json(head), allow_nan=False) + "\n", encoding="utf-8")
    elif todo:
        total = len(samples) * settings.reps
        print(f"resuming {path}: {total - len(todo)} of {total} (sample, pass) pairs already done", file=sys.stderr)
    warm = _warm_up_prompt(lm, [s for _, s in todo], methods[0].cfg.max_new_tokens)
    if warm is not None:
        warm_up({m.name: m.generate for m in methods}, warm, min(settings.warmup_tokens, methods[0].cfg.max_new_tokens))
    bar = tqdm(todo, desc=f"{lm.name} / {tasks.name}", unit="sample", file=sys.stderr)
    for i, (rep, sample) in enumerate(bar):
        if sample.id in skipped:  # found undecodable in an earlier pass of this run
            continue
        new_rows = []
        try:
            for m in rotated(methods, i):
                gen, texts = run_sample(m, lm, sample)
                new_rows.append(sample_row(sample, m.name, gen, texts, rep=rep))
        except SelfSpecError as e:  # this sample cannot be decoded (too long for the model, an empty turn)
            print(f"[selfspec] sample {sample.id} skipped: {e}", file=sys.stderr)
            append_lines(path, [{"type": "skipped", "sample_id": sample.id, "reason": str(e)}])
            skipped[sample.id] = str(e)
            continue
        new_rows.sort(key=lambda r: names.index(r["method"]))
        for r in new_rows:
            r["peak_rss_bytes"] = _peak_rss_bytes()
        new_rows = [strict_json(r) for r in new_rows]  # as the file holds them: no NaN (null instead)
        append_lines(path, new_rows)  # one write for the sample's rows
        rows.extend(new_rows)
        bar.set_postfix({short_name(r["method"]): f"{r['tokens_per_s']:.1f}t/s" for r in new_rows})
        if on_sample:
            on_sample(new_rows)
    ids = {s.id for s in samples}
    kept = [r for r in rows if r["sample_id"] in ids]
    if samples and not kept:  # nothing to compare: a run that measured nothing has not finished
        reasons = sorted(set(skipped.values()))
        raise SelfSpecError(f"every one of the {len(samples)} samples was skipped, so {path} holds no results "
                            f"({'; '.join(reasons[:3])}{'; ...' if len(reasons) > 3 else ''}): choose a dataset "
                            "whose prompts fit the model, or a model with a longer context")
    if skipped:
        print(f"[selfspec] {len(skipped)} sample(s) skipped, not in the results: {', '.join(sorted(skipped))}",
              file=sys.stderr)
    return kept


def _warm_up_prompt(lm: LoadedModel, todo: list[Sample], max_new_tokens: int) -> list[int] | None:
    """The first turn of the first sample that fits the model's context (None when none does)."""
    n_ctx = context_length(lm.model)
    for sample in todo:
        try:
            ids = encode_chat(lm.tokenizer, [{"role": "user", "content": sample.turns[0]}])
        except SelfSpecError:
            continue
        if ids and (n_ctx is None or len(ids) + max_new_tokens <= n_ctx):
            return ids
    return None


# progress-bar names: short, and still distinct for a method's variants (<method>-<label>)
_SHORT = {"autoregressive": "ar", "self_speculative": "ours", "hf_generate": "hf", "hf_prompt_lookup": "pld",
          "hf_assisted": "assisted", "hf_early_exit": "early_exit"}


def short_name(method: str) -> str:
    """A method's name for a progress bar: ``self_speculative-min2`` -> ``ours-min2``."""
    base, sep, label = method.partition("-")
    return _SHORT.get(base, base) + sep + label
