"""Several search processes on one study: storages, worker slots, claims, liveness.

Any number of ``python -m selfspec.search`` processes may share one study, on one
machine or on many:

- **Storage** (``search.storage``): a file path ending in ``.db`` is SQLite (one
  machine); a path ending in ``.journal`` is Optuna's journal file (a shared file
  system); a URL with ``://`` is any database SQLAlchemy reaches (PostgreSQL through
  psycopg 3 for several machines: ``postgresql+psycopg://user:password@host/db``).
- **Worker slots.** Each process takes the lowest free slot ``i`` (creating a
  marker study is atomic in every storage) and seeds its sampler with ``seed + i``,
  so workers propose different drafts; the slot is given back on exit.
- **Claims.** Work done once per study (calibration, writing the draft) is done by
  the process that creates the claim's marker study; the others wait for its result.
- **Liveness** (:class:`Liveness`, ``search.liveness``). What a worker holds (its slot,
  a claim, its running trial) records the worker (``host:pid``) and a heartbeat. A
  holder that is gone (a dead pid on this host, or no heartbeat for ``stale_after_s``
  seconds from another host) loses it: its trial is marked failed and run again, its
  claim and slot are taken over; a live worker's are never touched.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.exceptions import DuplicatedStudyError, UpdateFinishedTrialError
from optuna.trial import TrialState

from selfspec.errors import SelfSpecError
from selfspec.locks import check_writable

WORKER = f"{socket.gethostname()}:{os.getpid()}"
_MARK = "~"  # marker studies are named <study>~<what>


@dataclass(frozen=True)
class Liveness:
    """How the workers of a study tell that one of them died.

    A worker writes a heartbeat (``alive_at``) every ``heartbeat_s`` seconds on what it holds. A holder on another
    host with no heartbeat for ``stale_after_s`` seconds is taken for dead; on this host a dead pid decides at once.
    Each holder records its own ``stale_after_s`` beside its heartbeat and is judged by it, so workers started with
    other settings never take a live one for dead. Hosts' clocks must agree to well within ``stale_after_s``.
    """
    heartbeat_s: float = 20.0
    stale_after_s: float = 120.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "stale_after_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise SelfSpecError(f"search.liveness.{name} must be a number > 0, got {value!r}")
        if self.stale_after_s < 2 * self.heartbeat_s:  # one late heartbeat must not make a worker dead
            raise SelfSpecError(f"search.liveness.stale_after_s ({self.stale_after_s}) must be at least twice "
                                f"heartbeat_s ({self.heartbeat_s})")


LIVENESS = Liveness()
STALE_AFTER_S = LIVENESS.stale_after_s  # the judge of a holder that recorded no stale_after_s (an older selfspec's)


def storage_file(spec: str | Path) -> Path | None:
    """The file a storage lives in, or None for a database URL."""
    return None if "://" in str(spec) else Path(spec)


def journal_problem(path: Path) -> str:
    """The first line of a journal study file that is no journal record (the last line may be torn by a crash:
    Optuna skips it)."""
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines[:-1], 1):  # the last piece has no newline: torn or empty
        try:
            if not isinstance(json.loads(raw.decode("utf-8")), dict):
                raise ValueError
        except (ValueError, UnicodeDecodeError):
            return f"{path}, line {n} is not a journal record: {raw[:60].decode('utf-8', 'replace')!r}"
    return f"{path} cannot be read"


def open_storage(spec: str | Path) -> optuna.storages.BaseStorage:
    """SQLite for ``*.db`` paths, a journal file for ``*.journal``, else the database URL as given."""
    path = storage_file(spec)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if path is not None:
        check_writable(path.parent, f"the study storage {path.name}")
    if path is not None and path.suffix == ".journal":
        from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

        # the open(O_EXCL) lock works on network file systems, where symlinks may not
        try:
            return optuna.storages.JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SelfSpecError(f"the study journal {journal_problem(path)}: it was changed by hand or by another "
                                "program; remove that line (a study keeps every other trial) or start a new study "
                                "(search.study_name=...)") from None
    url, kwargs = str(spec), {}
    if path is not None:  # several processes write one SQLite file: wait for its lock instead of failing after 5 s
        url, kwargs = f"sqlite:///{path}", {"engine_kwargs": {"connect_args": {"timeout": 120}}}
    for attempt in range(5):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except Exception as e:  # a bad URL, a missing driver, a server that does not answer
            error = str(e).splitlines()[0]
            # workers creating a new database's tables at once collide (SQLite: locked or already there;
            # PostgreSQL: a duplicate key in its catalogue): the next attempt finds them made
            if not any(m in error for m in ("IntegrityError", "already exists", "database is locked", "duplicate key",
                                            "UniqueViolation")):
                break
            time.sleep(0.5 + attempt)
    raise SelfSpecError(f"cannot open the study storage {spec}: {error}")


# -- markers: atomic, storage-agnostic ------------------------------------------------------

def _create_marker(storage, name: str, live: Liveness) -> optuna.Study | None:
    try:
        marker = optuna.create_study(study_name=name, storage=storage)
    except DuplicatedStudyError:
        return None
    # the worker last: a judge that sees it sees when and how long it counts as alive (see _holder_alive)
    marker.set_user_attr("since", time.time())
    marker.set_user_attr("stale_after", live.stale_after_s)
    marker.set_user_attr("worker", WORKER)
    return marker


def _drop_marker(storage, name: str) -> None:
    try:
        optuna.delete_study(study_name=name, storage=storage)
    except KeyError:
        pass


def _marker_holder(storage, name: str) -> dict | None:
    try:
        return optuna.load_study(study_name=name, storage=storage).user_attrs
    except KeyError:
        return None


def _holder_alive(attrs: dict, stale_after: float = STALE_AFTER_S) -> bool:
    """Whether the process that wrote ``attrs`` (``worker``, and ``alive_at`` or ``since``) still runs.

    From another host: while its last heartbeat is younger than the ``stale_after`` it recorded (``stale_after``
    here for a holder that recorded none)."""
    worker = attrs.get("worker")
    if not worker:
        return True  # being written this instant
    host, _, pid = worker.rpartition(":")
    if host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, ValueError):
            pass
        return True
    beat = attrs.get("alive_at", attrs.get("since", 0.0))
    return time.time() - beat < attrs.get("stale_after", stale_after)


def _take(storage, name: str, live: Liveness = LIVENESS, stale_after: float = STALE_AFTER_S) -> optuna.Study | None:
    """Create marker ``name``, taking it over when its holder is gone; None while a live process holds it.

    ``stale_after``: the judge of a holder that recorded none (see :func:`_holder_alive`)."""
    marker = _create_marker(storage, name, live)
    if marker is not None:
        return marker
    holder = _marker_holder(storage, name)
    if holder is not None:
        if _holder_alive(holder, stale_after):
            return None
        _drop_marker(storage, name)
    return _create_marker(storage, name, live)


def _drop_dead_slots(storage, study_name: str) -> None:
    prefix = f"{study_name}{_MARK}worker-"
    for summary in storage.get_all_studies():
        if summary.study_name.startswith(prefix) and not _holder_alive(summary.user_attrs, float("inf")):
            _drop_marker(storage, summary.study_name)


@contextmanager
def _held(storage, name: str, live: Liveness, stale_after: float = STALE_AFTER_S) -> Iterator[bool]:
    """Marker ``name`` held for the block, its heartbeat kept fresh (False: a live process holds it)."""
    marker = _take(storage, name, live, stale_after)
    if marker is None:
        yield False
        return
    try:
        with heartbeat(marker, live):
            yield True
    finally:
        _drop_marker(storage, name)


@contextmanager
def worker_slot(storage, study_name: str, live: Liveness = LIVENESS) -> Iterator[int]:
    """The lowest free worker slot of the study, held for the block (a dead worker's slot is taken over, and the
    slots of every other dead worker are cleared, so none stays behind in the storage; a slot without a heartbeat,
    from an older selfspec on another host, never)."""
    _drop_dead_slots(storage, study_name)
    i = 0
    while True:
        with _held(storage, f"{study_name}{_MARK}worker-{i}", live, stale_after=float("inf")) as mine:
            if mine:
                yield i
                return
        i += 1


def claimed_once(storage, study_name: str, what: str, ready: Callable[[], object | None],
                 compute: Callable[[], object], poll_s: float = 2.0, live: Liveness = LIVENESS) -> object:
    """``ready()`` when it is not None, else ``compute()`` by exactly one of the workers.

    The worker that claims ``what`` computes, keeping the claim's heartbeat fresh; the others
    wait, print once whom they wait for, and take the result; a claim whose holder died is taken over.
    """
    said = False
    while True:
        value = ready()
        if value is not None:
            return value
        with holding(storage, study_name, what, live) as mine:
            if mine:
                value = ready()  # done by another worker between the check and the claim
                return value if value is not None else compute()
        holder = _marker_holder(storage, f"{study_name}{_MARK}{what}")
        if not said and holder is not None:
            print(f"[selfspec] waiting for {holder.get('worker')} ({what}, once per study)", file=sys.stderr)
            said = True
        time.sleep(poll_s)


def holding(storage, study_name: str, what: str, live: Liveness = LIVENESS):
    """Context manager: ``what`` claimed for this worker for the block, without waiting, its heartbeat kept fresh;
    it yields False when a live worker holds it."""
    return _held(storage, f"{study_name}{_MARK}{what}", live)


@contextmanager
def waiting(storage, study_name: str, what: str, live: Liveness = LIVENESS, poll_s: float = 2.0) -> Iterator[None]:
    """Context manager: ``what`` claimed for this worker for the block like :func:`holding`, waiting (asking again
    every ``poll_s``) while a live worker holds it; a dead holder's claim is taken over."""
    while True:
        with _held(storage, f"{study_name}{_MARK}{what}", live) as mine:
            if mine:
                yield
                return
        time.sleep(poll_s)


def try_claim(storage, study_name: str, what: str, live: Liveness = LIVENESS) -> bool:
    """Claim ``what`` until :func:`release`, without waiting and with no heartbeat; False when a live worker holds it."""
    return _take(storage, f"{study_name}{_MARK}{what}", live) is not None


def release(storage, study_name: str, what: str) -> None:
    _drop_marker(storage, f"{study_name}{_MARK}{what}")


# -- trial liveness -------------------------------------------------------------------------

@contextmanager
def heartbeat(held: optuna.Trial | optuna.Study, live: Liveness = LIVENESS) -> Iterator[None]:
    """Record this worker on ``held`` (a running trial, or a slot's or claim's marker study) and keep its heartbeat
    fresh while the block runs."""
    held.set_user_attr("alive_at", time.time())
    held.set_user_attr("stale_after", live.stale_after_s)
    held.set_user_attr("worker", WORKER)  # last, as in _create_marker
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(live.heartbeat_s):
            try:
                held.set_user_attr("alive_at", time.time())
            except Exception:  # the storage is busy or gone; the main thread will hear of it
                pass

    thread = threading.Thread(target=beat, name="selfspec-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _other_worker_alive(study: optuna.Study) -> bool:
    """Whether a worker slot of the study is held by a live process other than this one.

    On this host the holder's pid decides; from another host its heartbeat (a slot with
    none, an older selfspec's, counts as live).
    """
    prefix = f"{study.study_name}{_MARK}worker-"
    for s in study._storage.get_all_studies():
        if s.study_name.startswith(prefix) and s.user_attrs.get("worker") != WORKER:
            if _holder_alive(dict(s.user_attrs), stale_after=float("inf")):
                return True
    return False


def _trial_alive(t: optuna.trial.FrozenTrial, others: bool, live: Liveness) -> bool:
    """Whether ``t``'s worker still runs; ``others``: whether any other worker does."""
    attrs = dict(t.user_attrs)
    if "worker" not in attrs and t.datetime_start is not None:
        # asked but not yet started (its worker is between ask and heartbeat), or an older
        # selfspec's: alive only while some other worker lives, and for stale_after_s at most
        return others and time.time() - t.datetime_start.timestamp() < live.stale_after_s
    return _holder_alive(attrs)


def _running(study: optuna.Study, live: Liveness) -> list[tuple[optuna.trial.FrozenTrial, bool]]:
    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    others = any("worker" not in t.user_attrs for t in trials) and _other_worker_alive(study)
    return [(t, _trial_alive(t, others, live)) for t in trials]


def fail_dead_trials(study: optuna.Study, live: Liveness = LIVENESS) -> int:
    """Mark failed the running trials whose worker is gone; return how many."""
    n = 0
    for t, alive in _running(study, live):
        if not alive:
            try:
                study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            except UpdateFinishedTrialError:  # another worker marked it (or its own worker told it) just now
                continue
            n += 1
    return n


def running_elsewhere(study: optuna.Study, below: int | None = None, live: Liveness = LIVENESS) -> int:
    """Running trials of live workers (only those numbered below ``below`` when given)."""
    return sum(1 for t, alive in _running(study, live) if alive and (below is None or t.number < below))
