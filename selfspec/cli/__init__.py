"""Entry points: the only modules that import hydra, omegaconf or wandb.

- :mod:`selfspec.cli.search`: ``python -m selfspec.search`` (Hydra, ``conf/search.yaml``)
- :mod:`selfspec.cli.evaluate`: ``python experiments/evaluate.py`` (Hydra, ``conf/evaluate.yaml``)
- :mod:`selfspec.cli.generate`: ``python -m selfspec.generate`` (argparse)
- :mod:`selfspec.cli.tables`: ``python -m selfspec.tables`` (argparse)
- :mod:`selfspec.cli.wandb_logger`: the W&B logger both Hydra entry points use
- :mod:`selfspec.cli.config`: where ``conf/`` is, and configs turned into typed settings
"""

import os
import signal
import sys
import threading
from pathlib import Path


def _interrupted_while_starting(signum, frame) -> None:
    # nothing is written before an entry point's main runs: leave at once, without a traceback from inside an
    # import (or an interrupt an import swallows, after which the job would run on)
    sys.stderr.write("\ninterrupted while starting; nothing was written\n")
    sys.stderr.flush()
    os._exit(130)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt  # a scheduler's or a user's SIGTERM stops a job as Ctrl-C does: cleanly, resumable


def take_interrupts() -> None:
    """Ctrl-C, and SIGTERM (a kill, Slurm at a job's time limit), from here on raise KeyboardInterrupt, which each
    entry point turns into a clean stop that says what was kept."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and _run_as_entry_point():
        signal.signal(signal.SIGTERM, _terminated)


def _run_as_entry_point() -> bool:
    """Whether this process is one of selfspec's commands (not a test run or an interpreter importing it)."""
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    if not main:
        return False
    main, package = Path(main).resolve(), Path(__file__).resolve().parents[1]
    return main.name.startswith("selfspec-") or any(
        folder in main.parents for folder in (package, package.parent / "experiments", package.parent / "scripts"))


# importing an entry point (torch, transformers, hydra: seconds) ends quietly on Ctrl-C; its main takes them over
if (threading.current_thread() is threading.main_thread() and _run_as_entry_point()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
    signal.signal(signal.SIGINT, _interrupted_while_starting)
