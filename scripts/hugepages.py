"""What huge pages for the weight copies change in a decode's forwards (:mod:`selfspec.kernels.hugepages`), or what
another packing of the full model's weights does (``--kernels``).

    python scripts/hugepages.py [--model qwen2.5-coder-1.5b] [--draft results/plans/<model>-default.json]
                                [--dataset humaneval] [--reps 12] [--kernels fp16 amx]

Two instances of the model in one process, one whose copies were made with ``SELFSPEC_HUGEPAGES=0`` (4 KiB pages)
and one with them on huge pages, each with the draft's path, timed in turns (alternating which goes first, each turn
after an untimed forward) on one calibration prompt: plain steps (our AR), then twice a round's forwards, k draft steps
and a verify over k + 1 rows. The first draft step after a full-model forward is timed apart from the later ones: the
full forward streams the bf16-sized copies through the caches in between. Prints and appends one JSON line to --out:
medians per instance; the huge over the 4 KiB ones, their seconds summed over the turns, with a 95% paired-bootstrap
interval over the turns (the project's :func:`~selfspec.eval.records.seconds_ratio`); and what a round (one first
draft step, k - 1 later ones, one verify) costs in plain steps of its own instance, each way.

``--kernels A B``: the two instances both on huge pages, packed as ``A`` and ``B`` (``SELFSPEC_PACK``'s values: fp16
for our fp16 panels, amx for our AMX tiles, bf16 for oneDNN); ``B`` over ``A`` as above (``over_first``), appended to
``results/kernel_pair.jsonl`` unless ``--out`` says otherwise. The draft's int4 steps run the same kernel in both, so
a round's cost in plain steps says what the packing does to the decode speedup at the same acceptance.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch

from selfspec.assets.models import load_model
from selfspec.cli.config import calibration_prompts
from selfspec.draft.path import DraftPath
from selfspec.draft.spec import DraftSpec
from selfspec.engine.attention import decode_attention
from selfspec.engine.cache import PositionalKVCache
from selfspec.engine.decoding import forward_at
from selfspec.engine.stats import Clock
from selfspec.eval.records import seconds_ratio
from selfspec.kernels import hugepages
from selfspec.kernels.packed import PACK_KINDS, kernels_label, packed_weights, weight_packer
from selfspec.provenance import append_row, git_commit, machine_fingerprint

KINDS = ("plain", "first draft step", "later draft step", "verify")


def huge_bytes() -> int:
    """This process's anonymous memory on transparent huge pages (bytes; 0 where the kernel does not say)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages")), 0)
    except OSError:
        return 0


class Instance:
    """A model and its draft path, with every copy made (and advised, or not) while ``SELFSPEC_HUGEPAGES`` said so."""

    def __init__(self, model_name: str, dataset: str, spec: DraftSpec, huge: bool, kind: str | None = None) -> None:
        old = os.environ.get(hugepages.ENV)
        os.environ[hugepages.ENV] = "1" if huge else "0"
        try:
            self.lm = load_model(model_name)
            m = self.lm.model
            if kind:
                weight_packer(m, kind=kind)
            self.kernels = kernels_label(True, kind)  # what its full model computes on
            self.path = DraftPath(m, spec.plan, spec.options, stop_ids=self.lm.eos_ids)
            self.k = spec.k
            prompt = calibration_prompts(self.lm.tokenizer, [dataset], 1)[0]
            self.ctx, self.p = torch.tensor(prompt, dtype=torch.long), len(prompt)
            self.cache = PositionalKVCache(m, max_len=self.p + 2 * self.k + 8)
            with self.running():  # the packed copies are made here, the int4 ones by prepare() or the first draft step
                self.path.prepare(self.ctx)
                forward_at(m, self.cache, self.ctx, 0, keep=1)
                self.draft_steps(Clock())
        finally:
            if old is None:
                os.environ.pop(hugepages.ENV, None)
            else:
                os.environ[hugepages.ENV] = old

    @contextlib.contextmanager
    def running(self):
        m = self.lm.model
        with torch.inference_mode(), packed_weights(m), decode_attention(m):
            yield

    def full(self, n: int) -> None:
        forward_at(self.lm.model, self.cache, self.ctx[:n], self.p, keep=n)

    def draft_steps(self, clock: Clock) -> list[float]:
        """The seconds of each of k draft steps in a row."""
        out = []
        with self.path.drafting():
            for j in range(self.k):
                t0 = clock.now()
                forward_at(self.lm.model, self.cache, self.ctx[j:j + 1], self.p + j, keep=1)
                out.append(clock.now() - t0)
        return out

    def turn(self, clock: Clock) -> dict[str, list[float]]:
        """One turn's timings by :data:`KINDS` (after an untimed plain step)."""
        t: dict[str, list[float]] = {kind: [] for kind in KINDS}
        with self.running():
            self.full(1)
            for _ in range(3):
                t0 = clock.now()
                self.full(1)
                t["plain"].append(clock.now() - t0)
            for _ in range(2):
                steps = self.draft_steps(clock)
                t["first draft step"].append(steps[0])
                t["later draft step"] += steps[1:]
                t0 = clock.now()
                self.full(self.k + 1)
                t["verify"].append(clock.now() - t0)
        return {kind: [statistics.median(v)] for kind, v in t.items()}


def round_in_plain_steps(med: dict[str, float], k: int) -> float:
    return (med["first draft step"] + (k - 1) * med["later draft step"] + med["verify"]) / med["plain"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default=None, help="a draft file (default: results/plans/<model>-default.json)")
    ap.add_argument("--dataset", default="humaneval", help="the task set whose first calibration prompt is the context")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--kernels", nargs=2, choices=PACK_KINDS, default=None,
                    help="compare these two packings of the full model (both on huge pages) instead of the pages")
    ap.add_argument("--out", default=None, help="default: results/hugepages.jsonl, with --kernels results/kernel_pair.jsonl")
    args = ap.parse_args()
    if not hugepages.enabled():
        ap.error(f"huge pages cannot be asked for here (Linux's madvise, {hugepages.ENV} not 0)")
    if args.kernels and args.kernels[0] == args.kernels[1]:
        ap.error("--kernels: two different packings")
    draft = args.draft or f"results/plans/{args.model}-default.json"
    spec = DraftSpec.load(draft)
    machine, commit = machine_fingerprint(), git_commit()
    if args.kernels:
        inst = {kind: Instance(args.model, args.dataset, spec, huge=True, kind=kind) for kind in args.kernels}
        what = {"kernels": {n: i.kernels for n, i in inst.items()}}
    else:
        before = huge_bytes()
        inst = {"4 KiB pages": Instance(args.model, args.dataset, spec, huge=False)}
        mid = huge_bytes()
        inst["huge pages"] = Instance(args.model, args.dataset, spec, huge=True)
        what = {"huge_page_bytes": {"4 KiB pages": mid - before, "huge pages": huge_bytes() - mid}}
    clock = Clock()
    names = list(inst)
    times = {n: {kind: [] for kind in KINDS} for n in names}
    for rep in range(args.reps + 1):
        for n in names[rep % 2:] + names[:rep % 2]:
            turn = inst[n].turn(clock)
            if rep:  # repetition 0 is the warm-up
                for kind, v in turn.items():
                    times[n][kind] += v
    med = {n: {kind: statistics.median(v) for kind, v in per.items()} for n, per in times.items()}
    a, b = names
    paired = {kind: [round(v, 3) for v in seconds_ratio(times[a][kind], times[b][kind])] for kind in KINDS}
    rounds = {n: round(round_in_plain_steps(med[n], spec.k), 3) for n in names}
    over = "over_first" if args.kernels else "huge_over_4k"
    res = {"model": args.model, "draft": draft, "k": spec.k, "context_tokens": inst[a].p, "reps": args.reps,
           **what,
           "median_ms": {n: {kind: round(1e3 * v, 2) for kind, v in per.items()} for n, per in med.items()},
           over: {kind: v[0] for kind, v in paired.items()},
           f"{over}_interval": {kind: v[1:] for kind, v in paired.items()}, "round_in_plain_steps": rounds,
           "machine": machine, "git_commit": commit}
    print(json.dumps(res), flush=True)
    append_row(args.out or ("results/kernel_pair.jsonl" if args.kernels else "results/hugepages.jsonl"), res,
               echo=False)


if __name__ == "__main__":
    main()
