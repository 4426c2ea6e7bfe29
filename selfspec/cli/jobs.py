"""What every Hydra job of selfspec does the same way: threads, its config record, failure.

- :func:`set_threads`: ``threads`` in the config, else, under a parallel launcher, the
  cores divided among the jobs that run at once (joblib: ``n_jobs``; submitit:
  ``cpus_per_task``), so that parallel jobs do not fight over cores.
- :func:`save_config`: ``.hydra/`` is written by us, once the run folder has accepted
  the run (``hydra.output_subdir: null`` in the configs): a refused resume leaves the
  folder's record of what ran as it was.
- :func:`job_failed`: one line, a ``FAILED`` marker beside the job's results (not for a
  refused run: its folder holds valid results), a line in the sweep's ``FAILED_JOBS``;
  a single run exits with status 2, a sweep goes on.
- :class:`JobGuard` (``hydra.callbacks``): a run or sweep folder that cannot be written
  is one line and exit status 2 before anything runs; a sweep whose jobs failed ends with
  their list and exit status 1, whatever launcher ran them.
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from selfspec.errors import RunRefused, SelfSpecError
from selfspec.locks import check_writable

FAILED_JOBS = "FAILED_JOBS"  # one line per failed job of a sweep: time, job folder, first line of the error


def is_multirun() -> bool:
    return HydraConfig.get().mode == RunMode.MULTIRUN


def set_threads(cfg: DictConfig) -> int:
    """Set torch's thread count for this job; returns it."""
    n = cfg.get("threads")
    if n is None and is_multirun():
        launcher = HydraConfig.get().launcher
        target = str(launcher.get("_target_", ""))
        if "joblib" in target:
            jobs = launcher.get("n_jobs") or 1
            n = max(1, (os.cpu_count() or 1) // (jobs if jobs > 0 else (os.cpu_count() or 1)))
        elif "submitit" in target and launcher.get("cpus_per_task"):
            n = int(launcher.cpus_per_task)
    if n is not None:
        if not isinstance(n, int) or n < 1:
            raise SelfSpecError(f"threads must be an integer >= 1 (or null), got {n!r}")
        torch.set_num_threads(n)
    return torch.get_num_threads()


def save_config(cfg: DictConfig, out_dir: Path) -> None:
    """Write the job's composed config, Hydra's config and the overrides to ``<out_dir>/.hydra/``."""
    hc = HydraConfig.get()
    folder = out_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, folder / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hc, resolve=False)}), folder / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hc.overrides.task)), folder / "overrides.yaml")


# a write that failed for want of room or permission: the machine's state, not a bug to show a traceback for
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM}


def write_failure(error: BaseException) -> str | None:
    """One line for a write that failed (a full disk, a folder made read-only, a study's database that could not
    write), else None."""
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return f"cannot write{f' {e.filename}' if e.filename else ''}: {e.strerror}"
    if type(error).__name__ == "StorageInternalError" or isinstance(error, sqlite3.OperationalError):
        cause = error.__cause__ or error.__context__ or error
        return f"the study's storage could not write: {str(cause).strip().splitlines()[0]}"
    return None


def job_failed(error: BaseException, out_dir: Path, kept: str = "") -> None:
    """Report a failed job (see the module text); returns in a sweep, exits with 2 in a single run. ``kept``: what
    a failed write leaves behind and how to resume, said after it."""
    wrote = write_failure(error)
    if wrote:
        msg = f"{wrote}. {kept or 'Make room (or make the folder writable) and rerun the same command.'}"
    else:
        msg = str(error) if isinstance(error, SelfSpecError) else "".join(traceback.format_exception(error))
    print(f"error: {msg}" if not is_multirun() else f"error in {out_dir}: {msg}", file=sys.stderr)
    if not isinstance(error, RunRefused):
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "FAILED").write_text(msg + "\n")
        except OSError:
            pass  # the folder cannot be written (what failed): the message above is the record
    if not is_multirun():
        sys.exit(2)
    sweep = Path(HydraConfig.get().sweep.dir)
    first = msg.strip().splitlines()[0] if msg.strip() else type(error).__name__
    try:
        sweep.mkdir(parents=True, exist_ok=True)
        with open(sweep / FAILED_JOBS, "a", encoding="utf-8") as f:  # one short append: whole lines from many jobs
            f.write(f"{time.time():.3f}\t{out_dir}\t{first}\n")
    except OSError:
        pass


CHILD = "SELFSPEC_JOB_CHILD"  # set in a job's own process under the joblib launcher


def ran_in_child(cfg: DictConfig, module: str) -> bool:
    """Under the joblib launcher, run this job as a process of its own (``python -m module`` with the job's
    overrides and run folder) and wait for it; True when it ran there (the caller then returns).

    joblib's workers hold each other: one killed (the kernel's out-of-memory killer, a kill -9) ends the whole sweep,
    the other worker's job too. The job's own process is the one that holds the model, so it is the one such a kill
    takes, and its worker records it as this job's failure while the sweep goes on."""
    if os.environ.get(CHILD) or not is_multirun() or "joblib" not in str(HydraConfig.get().launcher.get("_target_", "")):
        return False
    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    threads = set_threads(cfg)
    task = [o for o in hc.overrides.task if not o.startswith("threads=")]
    folder = str(out_dir).replace("\\", "\\\\").replace("'", "\\'")  # quoted: a job folder's name holds '='
    cmd = [sys.executable, "-m", module, *task, f"hydra.run.dir='{folder}'", "hydra.mode=RUN", f"threads={threads}"]
    code = subprocess.run(cmd, env={**os.environ, CHILD: "1"}).returncode
    if code == 0:
        return True
    if code == 130:
        raise KeyboardInterrupt
    if code < 0:
        why = (f"the job's process was killed by {signal.Signals(-code).name} (out of memory, or by hand); what it "
               "finished is kept: rerun the sweep to resume it")
    else:  # it said why (and wrote its FAILED marker) itself
        failed = out_dir / "FAILED"
        why = failed.read_text().strip().splitlines()[0] if failed.is_file() else f"the job exited with status {code}"
    job_failed(SelfSpecError(why), out_dir)
    return True


def _writable_or_exit(folder: str, what: str) -> None:
    try:
        check_writable(Path(folder), what)
    except SelfSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)  # (SystemExit passes through Hydra: no traceback)


class JobGuard(Callback):
    """Checks the run or sweep folder before any job; exit status 1 at the end of a sweep in which a job failed."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _writable_or_exit(config.hydra.run.dir, "the run folder (hydra.run.dir)")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _writable_or_exit(config.hydra.sweep.dir, "the sweep folder (hydra.sweep.dir)")
        self.started = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        path = Path(config.hydra.sweep.dir) / FAILED_JOBS
        if not path.is_file():
            return
        failed = []
        for line in path.read_text(encoding="utf-8").splitlines():
            stamp, _, rest = line.partition("\t")
            try:
                if float(stamp) >= self.started - 1.0:
                    failed.append(rest.replace("\t", ": ", 1))
            except ValueError:
                continue
        if failed:
            print(f"\n{len(failed)} job(s) of this sweep failed (the others finished):", file=sys.stderr)
            for f in failed:
                print(f"  {f}", file=sys.stderr)
            sys.exit(1)
