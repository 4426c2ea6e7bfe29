"""What packing the weights costs in memory: the process's resident memory, per packing mode.

    python scripts/packed_memory.py [--model qwen2.5-coder-1.5b] [--modes loaded copies only]

Each mode runs in a fresh process: load the model; build our autoregressive and
self-speculative methods (the headline draft: int4 g32, 16k-token head, ngram 3)
with ``loaded`` = ``decoding.packed_weights=false``, ``copies`` = packed copies beside
the dense weights (the default), ``only`` = ``decoding.packed_only=true``; then decode
one calibration prompt with each. It records resident memory (VmRSS) after loading,
after building and after decoding, the peak (VmHWM), the methods' reported extra
memory, tokens/s and a hash of the tokens (the same in every mode). One JSON line
per mode is appended to --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
from pathlib import Path

from selfspec.provenance import append_row

MODES = {"loaded": {"packed_weights": False}, "copies": {}, "only": {"packed_only": True}}
DRAFT = {"weights": "int4", "group_size": 32, "head_tokens": 16384, "ngram": 3}


def _rss() -> dict:
    """Resident memory now: all of it, anonymous (heap) and file-backed (the mmapped checkpoint), in MB."""
    return {"rss": _status_mb("VmRSS"), "anon": _status_mb("RssAnon"), "file": _status_mb("RssFile")}


def _status_mb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return round(int(line.split()[1]) / 1024)  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(model: str, mode: str, max_new_tokens: int) -> dict:
    from selfspec import DecodeConfig, SkipPlan
    from selfspec.assets.models import load_model
    from selfspec.cli.config import calibration_prompts
    from selfspec.engine.harness import warm_up
    from selfspec.eval.methods import build_method
    from selfspec.provenance import git_commit

    lm = load_model(model)
    row = {"model": model, "mode": mode, "loaded_mb": _rss()}
    cfg = DecodeConfig(max_new_tokens=max_new_tokens, k=4, fallback=False, **MODES[mode])
    plan = SkipPlan(lm.num_layers)
    methods = [build_method("autoregressive", lm, cfg), build_method("self_speculative", lm, cfg, plan, DRAFT)]
    row["built_mb"] = _rss()
    prompt = calibration_prompts(lm.tokenizer, ["humaneval"], 1)[0]
    warm_up({m.name: m.generate for m in methods}, prompt, 8)
    for m in methods:
        gen = m.generate(prompt)
        row[m.name] = {"extra_mb": round(m.extra_memory_bytes / 2**20),
                       "tok_s": round(gen.stats.summary()["tokens_per_s"], 2),
                       "tokens_sha": hashlib.sha1(json.dumps(gen.tokens).encode()).hexdigest()[:12]}
    row.update(decoded_mb=_rss(), peak_rss_mb=_status_mb("VmHWM"), max_new_tokens=max_new_tokens,
               git_commit=git_commit())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="results/packed_memory.jsonl")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, args.child, args.max_new_tokens)), flush=True)
        return
    for mode in args.modes:  # a fresh process each: resident memory does not shrink back reliably
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--model", args.model,
                              "--max-new-tokens", str(args.max_new_tokens)],
                             capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        append_row(args.out, row, echo=False)


if __name__ == "__main__":
    main()
