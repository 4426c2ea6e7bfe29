"""What drafting on one core while the other verifies could add: the bound of a pipelined round, from measured times.

    python scripts/two_cores.py [--draft results/plans/qwen2.5-coder-1.5b-zen4-exit.json] [--model M] [--keys 300] [--steps 7]
        [--rows 8] [--seconds 15] [--reps 3] [--share 0.5 ...] [--threads N]

A round drafts ``--steps`` tokens (one-row steps of the draft file's draft) and verifies them in one forward of
``--rows`` rows; decoding runs both on all the cores, one after the other. A pipeline would run them side by side, one
core each: while round r is verified, round r+1 is drafted on the guess that r is accepted whole. Two worker
processes (the draft's, and the full model's for verifies and our AR's one-row steps) each load the model once and
time, in rotating order after a warm-up: the draft and the verify on all the cores and on one, alone, and the two on
one core each at the same time (``together``). Medians over ``--seconds`` of repetitions, each configuration
``--reps`` times; the record keeps every repetition's medians and the median of them.

The bound: a round whose draft was accepted whole (a share ``p`` of the model's rounds) costs the longer of its two
one-core parts run together, ``max(steps * d1, v1)``; every other round costs what it costs now, ``steps * d + v``
(as if a pipeline knew beforehand which rounds to overlap, and lost nothing on the rest). Its gain on the model's
rounds is ``1 / (1 - p * (1 - max(steps * d1, v1) / (steps * d + v)))``, printed for each ``--share``. Without that
foresight, a round that is not accepted whole costs its verify on one core, beside a draft that is thrown away, and
its successor's draft after it, ``v1 + steps * d``: the share ``p`` at which always overlapping breaks even is
printed too. Appends one JSON line to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

ROLES = ("draft", "full")
ROLE_OF = {"draft": "draft", "verify": "full", "ar": "full"}  # which worker times what
DEFAULT_MODEL = "qwen2.5-coder-1.5b"  # where neither --model nor the draft file names one


def worker(args: argparse.Namespace) -> None:
    """A role's process: load, warm up, then answer ``<what> <threads> <seconds>`` lines with one JSON line each."""
    import torch

    from selfspec.assets.models import load_model
    from selfspec.draft.path import DraftPath
    from selfspec.draft.spec import DraftSpec
    from selfspec.engine.attention import decode_attention
    from selfspec.engine.cache import PositionalKVCache
    from selfspec.engine.decoding import forward_at
    from selfspec.kernels.packed import packed_weights

    spec = DraftSpec.load(args.draft)
    model = load_model(args.model or spec.plan.provenance.get("model") or DEFAULT_MODEL).model
    draft = DraftPath(model, spec.plan, spec.options) if args.worker == "draft" else None
    ctx = (1000 + torch.arange(args.keys)) % model.config.vocab_size  # any ids: the times do not depend on them
    cache = PositionalKVCache(model, max_len=args.keys + max(args.steps, args.rows) + 16)
    if draft is not None:
        draft.prepare(ctx)

    def once(what: str) -> None:
        if what == "draft":
            with draft.drafting():
                for j in range(args.steps):
                    forward_at(model, cache, ctx[-1:], args.keys + j, keep=1)
        else:  # a verify of --rows rows, or our AR's one-row step
            rows = args.rows if what == "verify" else 1
            forward_at(model, cache, ctx[-rows:], args.keys, keep=rows)

    with torch.inference_mode(), packed_weights(model), decode_attention(model, True):
        forward_at(model, cache, ctx, 0, keep=1)
        for what in ("draft",) if draft is not None else ("verify", "ar"):
            for _ in range(3):
                once(what)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            what, threads, seconds = line.split()
            torch.set_num_threads(int(threads))
            once(what)
            times, end = [], time.perf_counter() + float(seconds)
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                once(what)
                times.append(time.perf_counter() - t0)
            print(json.dumps({"ms": statistics.median(times) * 1e3, "n": len(times)}), flush=True)


class Worker:
    def __init__(self, role: str, args: argparse.Namespace) -> None:
        cmd = [sys.executable, __file__, "--worker", role, "--draft", args.draft, "--keys", str(args.keys),
               "--steps", str(args.steps), "--rows", str(args.rows), *(["--model", args.model] if args.model else [])]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.reply()

    def ask(self, what: str, threads: int, seconds: float) -> None:
        self.proc.stdin.write(f"{what} {threads} {seconds}\n")
        self.proc.stdin.flush()

    def reply(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker stopped (exit {self.proc.wait()}); its error is above")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def bound(now: float, overlapped: float, share: float) -> float:
    """The pipelined round's gain on the model's rounds, with foresight (module docstring): the ``share`` of them
    accepted whole costs ``overlapped`` where a round costs ``now``."""
    return 1 / (1 - share * (1 - overlapped / now))


def main() -> None:
    from selfspec.engine.harness import rotated
    from selfspec.provenance import append_row, git_commit, machine_fingerprint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", default="results/plans/qwen2.5-coder-1.5b-zen4-exit.json")
    ap.add_argument("--model", help="the packaged model (default: the one the draft file names)")
    ap.add_argument("--keys", type=int, default=300, help="tokens in the cache before the round")
    ap.add_argument("--steps", type=int, default=7, help="draft steps a round")
    ap.add_argument("--rows", type=int, default=8, help="rows a verify")
    ap.add_argument("--seconds", type=float, default=15.0, help="seconds a configuration is timed, each repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--share", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0],
                    help="shares of the model's rounds accepted whole, to price")
    ap.add_argument("--threads", type=int, help="threads on all the cores (default: torch's count here)")
    ap.add_argument("--out", default="results/two_cores.jsonl")
    ap.add_argument("--worker", choices=ROLES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if min(args.steps, args.rows, args.reps) < 1 or args.seconds <= 0:
        ap.error("--steps, --rows and --reps must be at least 1, --seconds above 0")
    import torch

    cores = args.threads or torch.get_num_threads()
    if cores < 2:
        raise SystemExit(f"two_cores.py compares all the cores with one core each of two: torch runs {cores} thread here "
                         "(--threads sets how many)")
    workers = {role: Worker(role, args) for role in ROLES}
    configs = [f"draft x{cores}", f"verify x{cores}", f"ar x{cores}", "draft x1", "verify x1", "together"]
    runs: dict[str, list[float]] = {}
    try:
        for rep in range(args.reps):
            for name in rotated(configs, rep):
                together = name == "together"
                whats = ("draft", "verify") if together else (name.split()[0],)
                for what in whats:
                    workers[ROLE_OF[what]].ask(what, 1 if together or name.endswith("x1") else cores, args.seconds)
                done = [f"{what} together" if together else name for what in whats]
                for what, key in zip(whats, done):
                    ms = workers[ROLE_OF[what]].reply()["ms"] / (args.steps if what == "draft" else 1)
                    runs.setdefault(key, []).append(round(ms, 2))
                print(f"{rep}: " + ", ".join(f"{k} {runs[k][-1]:.1f} ms" for k in done), flush=True)
    finally:
        for w in workers.values():
            w.close()
    t = {k: statistics.median(v) for k, v in runs.items()}
    now = args.steps * t[f"draft x{cores}"] + t[f"verify x{cores}"]
    overlapped = max(args.steps * t["draft together"], t["verify together"])
    missed = t["verify together"] + args.steps * t[f"draft x{cores}"]
    # overlapping every round costs (1 - p) * missed + p * overlapped: the least share p where that is at most now
    even = 0.0 if missed <= now else None if overlapped > now else (missed - now) / (missed - overlapped)
    gains = {str(p): round(bound(now, overlapped, p), 4) for p in args.share}
    print(f"a round now {now:.1f} ms ({args.steps} draft steps of {t[f'draft x{cores}']:.1f} ms on {cores} cores, a "
          f"verify of {args.rows} rows {t[f'verify x{cores}']:.1f} ms; our AR's step {t[f'ar x{cores}']:.1f} ms); "
          "overlapped on one core each "
          f"{overlapped:.1f} ms (draft steps {t['draft together']:.1f} ms, the verify {t['verify together']:.1f} ms; "
          f"alone on one core {t['draft x1']:.1f} / {t['verify x1']:.1f} ms)")
    print("bound on the model's rounds, by the share accepted whole: " +
          ", ".join(f"{p} -> {g:.3f}x" for p, g in gains.items()) +
          ("; always overlapping breaks even at a share of " + (f"{even:.2f}" if even is not None else "none: it never pays")))
    append_row(args.out, {"draft": args.draft, "model": args.model, "keys": args.keys, "steps": args.steps, "rows": args.rows,
                          "seconds": args.seconds, "reps": args.reps, "cores": cores, "runs_ms": runs,
                          "median_ms": {k: round(v, 3) for k, v in t.items()}, "round_ms": round(now, 3),
                          "overlapped_ms": round(overlapped, 3), "bound": gains,
                          "break_even_share": None if even is None else round(even, 3),
                          "machine": machine_fingerprint(), "git_commit": git_commit()}, echo=False)


if __name__ == "__main__":
    main()
