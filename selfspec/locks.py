"""Guards for what a run writes: a folder checked writable up front, and one writer at a time.

:func:`check_writable` fails before long work, not after it, when a folder cannot be written.
:func:`exclusive` takes an exclusive, non-blocking lock on a file beside what is written.

A run folder's ``samples.jsonl`` and a study's storage each get a ``.lock`` file; a second
process that tries to write the same results while the first holds it gets one clear error
instead of doubled rows or two cost models. The lock is released when the holder exits,
also when it is killed (the kernel drops ``flock`` locks with the process).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selfspec.errors import SelfSpecError


def check_writable(folder: Path, what: str) -> None:
    """Create ``folder`` and write a probe file in it, or raise one :class:`SelfSpecError` naming ``what``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".selfspec-write-probe"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SelfSpecError(f"cannot write {what} at {folder}: {e.strerror or e}") from None


@contextmanager
def exclusive(target: Path, what: str) -> Iterator[None]:
    """Hold ``<target>.lock`` for the block; raise :class:`SelfSpecError` when another process holds it."""
    lock = target.with_name(target.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise SelfSpecError(f"cannot write {what} (at {lock.parent}): {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SelfSpecError(f"{what} is being written by another process (lock {lock}); "
                                "wait for it to finish, or write elsewhere") from None
        yield
    finally:
        os.close(fd)
