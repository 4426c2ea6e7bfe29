"""Send Ctrl-C to the tiny model's search again and again; report the tries that do not end cleanly.

    python scripts/ctrl_c_loop.py [--tries 30]

Each try starts ``python -m selfspec.search`` on the tiny model with a huge trial budget, waits for
3 finished trials, waits a random 0-0.5 s more, sends SIGINT and expects exit code 130 with the
"interrupted" message within 20 s. A try that hangs gets SIGABRT, so Python's fault handler prints
where every thread stood, and the loop stops (results/PERF.md, 2026-11-23).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tries", type=int, default=30)
    args = ap.parse_args()
    hangs = bad = 0
    for i in range(args.tries):
        work = Path(tempfile.mkdtemp(prefix="selfspec-ctrl-c-"))
        db = work / "optuna" / "study.db"
        p = subprocess.Popen(
            [sys.executable, "-m", "selfspec.search", "model=tiny-llama", "search=quick", f"search.storage={db}",
             f"plans_dir={work}/plans", f"hydra.run.dir={work}/hydra", "logger=none", "search.n_trials=100000"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "PYTHONFAULTHANDLER": "1"},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal's foreground job
        done = 0
        while done < 3 and p.poll() is None:
            time.sleep(0.1)
            try:
                with sqlite3.connect(db) as con:
                    done = con.execute("select count(*) from trials where state='COMPLETE'").fetchone()[0]
            except sqlite3.OperationalError:
                pass
        time.sleep(random.random() * 0.5)
        p.send_signal(signal.SIGINT)
        try:
            _, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGABRT)
            _, err = p.communicate()
            print(f"try {i}: HANG\n{err[-6000:]}", flush=True)
            hangs += 1
            break
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if p.returncode != 130 or "interrupted" not in err:
            bad += 1
            print(f"try {i}: exit {p.returncode}\n{err[-1500:]}", flush=True)
    print(f"{i + 1} tries: {hangs} hung, {bad} ended otherwise than with the clean message")
    return 1 if hangs or bad else 0


if __name__ == "__main__":
    sys.exit(main())
