"""What several test files share that is not a fixture: the repository's folders, a prompt, an entry point run in
this process."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the repository
CONF = ROOT / "conf"

PROMPT = list(range(3, 20))

# a HumanEval row: what the task set loads and what the scorer runs
HUMANEVAL_REF = {"prompt": 'def add(a, b):\n    """Return a + b."""\n', "entry_point": "add",
                 "test": "def check(f):\n    assert f(1, 2) == 3\n    assert f(-1, 1) == 0\n"}


def run_main(main: Callable[..., object], *args: str, capsys=None) -> subprocess.CompletedProcess:
    """An entry point's ``main`` run in this process with ``args`` as its command line (``sys.argv`` for a Hydra
    entry point, the argument list for one that takes it), as a finished process: its exit status and, with pytest's
    ``capsys``, what it printed.

    Hydra points the root logger at the run folder and at the stream it found: both are put back, so that a later
    test logs nowhere that was closed."""
    argv, handlers, level = sys.argv, logging.root.handlers[:], logging.root.level
    sys.argv = [main.__module__, *args]
    try:
        hydra = hasattr(main, "__wrapped__")  # a @hydra.main function reads sys.argv; the others take their argv
        code = main() if hydra else main(list(args))
    except SystemExit as e:
        code = e.code
    finally:
        sys.argv = argv
        for handler in logging.root.handlers[:]:
            if handler not in handlers:
                logging.root.removeHandler(handler)
                handler.close()
        for handler in handlers:
            if handler not in logging.root.handlers:
                logging.root.addHandler(handler)
        logging.root.setLevel(level)
    code = code if isinstance(code, int) else (0 if code is None else 1)
    out, err = capsys.readouterr() if capsys is not None else ("", "")
    return subprocess.CompletedProcess([main.__module__, *args], code, out, err)

