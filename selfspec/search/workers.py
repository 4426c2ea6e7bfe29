"""Several search processes on one study: storages, worker slots, claims, liveness.

Any number of ``python -m selfspec.search`` processes may share one study, on one
machine or on many:

- **Storage** (``search.storage``): a file path ending in ``.db`` is SQLite (one
  machine); a path ending in ``.journal`` is Optuna's journal file (a shared file
  system); a URL with ``://`` is any database SQLAlchemy reaches (PostgreSQL for a
  cluster: ``postgresql://user@host/db``).
- **Worker slots.** Each process takes the lowest free slot ``i`` (creating a
  marker study is atomic in every storage) and seeds its sampler with ``seed + i``,
  so workers propose different drafts; the slot is given back on exit.
- **Claims.** Work done once per study (calibration, writing the draft) is done by
  the process that creates the claim's marker study; the others wait for its result.
- **Liveness.** A running trial records its worker (``host:pid``) and a heartbeat
  every :data:`HEARTBEAT_S` seconds. A trial whose worker is gone (a dead pid on this
  host, or no heartbeat for :data:`STALE_AFTER_S` seconds from another host) is
  marked failed and run again; a live worker's trials are never touched.
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
from pathlib import Path

import optuna
from optuna.exceptions import DuplicatedStudyError
from optuna.trial import TrialState

from selfspec.errors import SelfSpecError
from selfspec.locks import check_writable

HEARTBEAT_S = 20.0
STALE_AFTER_S = 120.0
WORKER = f"{socket.gethostname()}:{os.getpid()}"
_MARK = "~"  # marker studies are named <study>~<what>


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
            # workers creating a new database's tables at once collide: the next attempt finds them made
            if not any(m in error for m in ("IntegrityError", "already exists", "database is locked")):
                break
            time.sleep(0.5 + attempt)
    raise SelfSpecError(f"cannot open the study storage {spec}: {error}")


# -- markers: atomic, storage-agnostic ------------------------------------------------------

def _create_marker(storage, name: str) -> bool:
    try:
        marker = optuna.create_study(study_name=name, storage=storage)
    except DuplicatedStudyError:
        return False
    marker.set_user_attr("worker", WORKER)
    marker.set_user_attr("since", time.time())
    return True


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
    """Whether the process that wrote ``attrs`` (``worker``, and ``alive_at`` or ``since``) still runs."""
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
    return time.time() - beat < stale_after


def _take(storage, name: str, stale_after: float = STALE_AFTER_S) -> bool:
    """Create marker ``name``, taking it over when its holder is gone; False while a live process holds it."""
    if _create_marker(storage, name):
        return True
    holder = _marker_holder(storage, name)
    if holder is not None:
        if _holder_alive(holder, stale_after):
            return False
        _drop_marker(storage, name)
    return _create_marker(storage, name)


def _drop_dead_slots(storage, study_name: str) -> None:
    prefix = f"{study_name}{_MARK}worker-"
    for summary in storage.get_all_studies():
        if summary.study_name.startswith(prefix) and not _holder_alive(summary.user_attrs, float("inf")):
            _drop_marker(storage, summary.study_name)


@contextmanager
def worker_slot(storage, study_name: str) -> Iterator[int]:
    """The lowest free worker slot of the study, held for the block (a dead worker's slot on this host is taken over,
    and the slots of every other dead worker of this host are cleared, so none stays behind in the storage)."""
    _drop_dead_slots(storage, study_name)
    i = 0
    while not _take(storage, f"{study_name}{_MARK}worker-{i}", stale_after=float("inf")):
        i += 1
    try:
        yield i
    finally:
        _drop_marker(storage, f"{study_name}{_MARK}worker-{i}")


def claimed_once(storage, study_name: str, what: str, ready: Callable[[], object | None],
                 compute: Callable[[], object], poll_s: float = 2.0) -> object:
    """``ready()`` when it is not None, else ``compute()`` by exactly one of the workers.

    The worker that claims ``what`` computes; the others wait, print once whom they
    wait for, and take the result; a claim whose holder died is taken over.
    """
    said = False
    while True:
        value = ready()
        if value is not None:
            return value
        if try_claim(storage, study_name, what):
            try:
                value = ready()  # done by another worker between the check and the claim
                return value if value is not None else compute()
            finally:
                release(storage, study_name, what)
        holder = _marker_holder(storage, f"{study_name}{_MARK}{what}")
        if not said and holder is not None:
            print(f"[selfspec] waiting for {holder.get('worker')} ({what}, once per study)", file=sys.stderr)
            said = True
        time.sleep(poll_s)


def try_claim(storage, study_name: str, what: str) -> bool:
    """Claim ``what`` for this worker without waiting; False when a live worker holds it."""
    return _take(storage, f"{study_name}{_MARK}{what}")


def release(storage, study_name: str, what: str) -> None:
    _drop_marker(storage, f"{study_name}{_MARK}{what}")


# -- trial liveness -------------------------------------------------------------------------

@contextmanager
def heartbeat(trial: optuna.Trial) -> Iterator[None]:
    """Record this worker on ``trial`` and keep its heartbeat fresh while the block runs."""
    trial.set_user_attr("worker", WORKER)
    trial.set_user_attr("alive_at", time.time())
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                trial.set_user_attr("alive_at", time.time())
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

    Slots held from another host count as live (they carry no heartbeat); on this host
    the holder's pid decides.
    """
    prefix = f"{study.study_name}{_MARK}worker-"
    for s in study._storage.get_all_studies():
        if s.study_name.startswith(prefix) and s.user_attrs.get("worker") != WORKER:
            if _holder_alive(dict(s.user_attrs), stale_after=float("inf")):
                return True
    return False


def _trial_alive(t: optuna.trial.FrozenTrial, others: bool) -> bool:
    """Whether ``t``'s worker still runs; ``others``: whether any other worker does."""
    attrs = dict(t.user_attrs)
    if "worker" not in attrs and t.datetime_start is not None:
        # asked but not yet started (its worker is between ask and heartbeat), or an older
        # selfspec's: alive only while some other worker lives, and for STALE_AFTER_S at most
        return others and time.time() - t.datetime_start.timestamp() < STALE_AFTER_S
    return _holder_alive(attrs)


def _running(study: optuna.Study) -> list[tuple[optuna.trial.FrozenTrial, bool]]:
    trials = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    others = any("worker" not in t.user_attrs for t in trials) and _other_worker_alive(study)
    return [(t, _trial_alive(t, others)) for t in trials]


def fail_dead_trials(study: optuna.Study) -> int:
    """Mark failed the running trials whose worker is gone; return how many."""
    n = 0
    for t, alive in _running(study):
        if not alive:
            study._storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
            n += 1
    return n


def running_elsewhere(study: optuna.Study, below: int | None = None) -> int:
    """Running trials of live workers (only those numbered below ``below`` when given)."""
    return sum(1 for t, alive in _running(study) if alive and (below is None or t.number < below))
