"""Guards for what a run writes: a folder checked writable up front, and one writer at a time.

:func:`check_writable` fails before long work, not after it, when a folder cannot be written.
:func:`exclusive` takes an exclusive, non-blocking lock on a file beside what is written.
:func:`waiting` takes the same lock but waits for it (the download cache: the first of
several jobs fetches, the others wait and then find the file there).

A run folder's ``samples.jsonl`` gets a ``.lock`` file: a second process that tries to write
the same results while the first holds it gets one clear error instead of doubled rows.
(Search workers share a study by design: :mod:`selfspec.search.workers`.) A lock is
released when its holder exits, also when it is killed (the kernel drops ``flock`` locks
with the process).
"""

from __future__ import annotations

import fcntl
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selfspec.errors import RunRefused, SelfSpecError


def check_writable(folder: Path, what: str) -> None:
    """Create ``folder`` and write a probe file in it, or raise one :class:`SelfSpecError` naming ``what``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # a probe of its own: two workers checking one folder at once must not delete each other's
        probe = folder / f".selfspec-write-probe-{os.getpid()}-{uuid.uuid4().hex}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SelfSpecError(f"cannot write {what} at {folder}: {e.strerror or e}") from None


def _open_lock(target: Path, what: str) -> int:
    lock = target.with_name(target.name + ".lock")
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        return os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise SelfSpecError(f"cannot write {what} (at {lock.parent}): {e.strerror or e}") from None


@contextmanager
def waiting(target: Path, what: str) -> Iterator[None]:
    """Hold ``<target>.lock`` for the block, waiting (and saying so once) while another process holds it."""
    with _held(target, what, wait=True):
        yield


@contextmanager
def exclusive(target: Path, what: str) -> Iterator[None]:
    """Hold ``<target>.lock`` for the block; raise :class:`RunRefused` when another process holds it."""
    with _held(target, what, wait=False):
        yield


@contextmanager
def _held(target: Path, what: str, wait: bool) -> Iterator[None]:
    fd = _open_lock(target, what)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                raise RunRefused(f"{what} is being written by another process (lock {target.name}.lock); "
                                 "wait for it to finish, or write elsewhere") from None
            print(f"[selfspec] waiting for another process to finish {what}", file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
