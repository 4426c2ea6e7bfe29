"""The search's workers on a PostgreSQL server: three processes on one study, one of them killed with SIGKILL mid-trial.

The test starts a throwaway server of its own (initdb and pg_ctl, run as an unprivileged user when the test runs as
root, which they refuse; a unix socket in a private folder, no TCP port) and reaches it through psycopg 3
(``postgresql+psycopg://``), as workers on several machines would share one study (docs/scaling.md). Where this
process may (root), each worker runs under a host name of its own (a UTS namespace, ``unshare --uts``), so the
workers can tell a dead one only by its heartbeat, as on separate machines; elsewhere they share this host, where a
dead pid tells at once.
"""

import glob
import itertools
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from selfspec.draft.spec import DraftSpec
from selfspec.search import workers
from selfspec.search.study import finished

N_TRIALS = 24
_DATABASES = itertools.count()
STUDY = "pg-three"
# a tiny-model search whose drafts the trials' predictions alone decide (none is chosen by a timing), so that the
# same trials pick the same draft on any number of workers
SEARCH = ["model=tiny-llama", "search=quick", "logger=none", "threads=1",
          "search.prune=false",  # the median pruner judges a trial by the ones told before it: an order workers change
          "search.min_skipped=1", "search.space.skipping=[true]", "search.space.model_draft=[true]",
          "search.retime.top_n=1",  # and with min_skipped=1 no skip-free twin joins the re-timing: one candidate
          "search.space.weights=[model]", "search.space.head_weights=[model]",  # no int4 kernel to build
          "search.space.copy_candidates=[1]", "search.space.branch_below=[0.0]",  # chains: a short cost model
          "search.calibration_tokens=48", "search.batch=1",  # trials of ~0.4 s: long enough to be caught running
          "search.liveness.heartbeat_s=0.5", "search.liveness.stale_after_s=5"]


def _missing(reason: str):
    """Skip where PostgreSQL is not installed; CI (.ci/run installs it) fails instead of passing on a skip."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


def _server_bin() -> Path | None:
    """The folder of the newest PostgreSQL server's initdb and pg_ctl (Debian's /usr/lib/postgresql/N/bin, or PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: [int(x) for x in Path(p).parts[4].split(".")
                                                                                if x.isdigit()])
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb and shutil.which("pg_ctl") else None


def _as_server_user() -> dict:
    """subprocess arguments that run the server's programs as an unprivileged user (they refuse to run as root)."""
    if os.geteuid() != 0:
        return {}
    for name in ("postgres", "nobody"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
    _missing("running as root with no 'postgres' or 'nobody' user to run the PostgreSQL server as")


@pytest.fixture(scope="module")
def postgres_server():
    """A throwaway PostgreSQL server for this file's tests; yields the folder of its unix socket. Stopped and removed
    at the end, whatever the tests did."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        _missing("no PostgreSQL driver for Python: pip install -e '.[test]' (psycopg[binary])")
    bindir = _server_bin()
    if bindir is None:
        _missing("no PostgreSQL server (initdb, pg_ctl): apt-get install postgresql")
    as_user = _as_server_user()
    # not under tmp_path: pytest's folders are readable by their owner only, and the server runs as another user
    home = Path(tempfile.mkdtemp(prefix="selfspec-pg-"))
    if as_user:
        os.chown(home, as_user["user"], as_user["group"])
    data, log = home / "data", home / "server.log"
    env = {**os.environ, "LC_ALL": "C", "LANG": "C"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(bindir / args[0]), *args[1:]], capture_output=True, text=True, env=env, cwd=home,
                              timeout=120, **as_user)

    try:
        made = run("initdb", "-D", str(data), "-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-locale",
                   "--no-sync")
        assert made.returncode == 0, made.stdout + made.stderr
        started = run("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "60", "start", "-o",
                      f"-c listen_addresses='' -k {home} -c fsync=off -c synchronous_commit=off")
        assert started.returncode == 0, started.stdout + started.stderr + (log.read_text() if log.exists() else "")
        yield home
    finally:
        if (data / "postmaster.pid").exists():
            run("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def postgres(postgres_server):
    """A new, empty database on the server; yields its SQLAlchemy URL."""
    import psycopg

    name = f"test_{next(_DATABASES)}"
    with psycopg.connect(host=str(postgres_server), user="postgres", dbname="postgres", autocommit=True) as con:
        con.execute(f"CREATE DATABASE {name}")
    return f"postgresql+psycopg://postgres@/{name}?host={postgres_server}"


def _own_hosts() -> bool:
    """Whether each worker can run under a host name of its own (a UTS namespace: root, and unshare allowed)."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("hostname"):
        return False
    return subprocess.run(["unshare", "--uts", "hostname", "node-x"], capture_output=True).returncode == 0


def _worker(tmp_path: Path, name: str, url: str, study: str, n_trials: int, host: str | None) -> subprocess.Popen:
    """``python -m selfspec.search`` as one worker of ``study``, with its own run and plans folders (as on a machine
    of its own), on host name ``host`` (None: this host's); its output in ``<tmp_path>/<name>.out`` and ``.err``."""
    args = [sys.executable, "-m", "selfspec.search", *SEARCH, f"search.n_trials={n_trials}",
            f"search.storage='{url}'", f"search.study_name={study}",  # quoted: Hydra reads '=' as an override's
            f"plans_dir={tmp_path}/{name}/plans", f"hydra.run.dir={tmp_path}/{name}/run"]
    if host is not None:  # exec keeps the pid: the worker records itself as <host>:<this Popen's pid>
        args = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', host, *args]
    with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
        return subprocess.Popen(args, stdout=out, stderr=err, text=True)


def _kill_mid_trial(proc: subprocess.Popen, worker: str, study: str, url: str, err: Path, timeout: float = 180) -> int:
    """SIGKILL the worker ``proc`` (recorded as ``worker``) while it runs a trial; that trial's number.

    The worker is stopped (SIGSTOP) for each look at the study, so the trial it was running is still running when it
    is killed; where it ran none, it goes on (SIGCONT), well within its heartbeat's stale_after_s.
    """
    storage = workers.open_storage(url)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"the worker to kill ended first, with status {proc.returncode}:\n{err.read_text()}"
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            trials = optuna.load_study(study_name=study, storage=storage).get_trials(states=(TrialState.RUNNING,))
        except KeyError:  # the study is not made yet
            trials = []
        mine = [t.number for t in trials if t.user_attrs.get("worker") == worker]
        if mine:
            proc.kill()
            proc.wait()  # reaped: a zombie's pid would still answer on this host
            return mine[0]
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.1)
    pytest.fail(f"worker {worker} ran no trial within {timeout:.0f} s")


def _outcomes(study: optuna.Study) -> list[tuple[str, str, float | None]]:
    """Each finished trial's draft parameters, state and value, in a fixed order."""
    return sorted((json.dumps(t.params, sort_keys=True), t.state.name, t.value)
                  for t in study.get_trials(states=(TrialState.COMPLETE, TrialState.PRUNED)))


@pytest.mark.cli
def test_three_workers_on_postgres_one_killed_mid_trial(tmp_path, postgres):
    own_hosts = _own_hosts()
    hosts = [f"node-{i}" if own_hosts else None for i in range(3)]
    procs = [_worker(tmp_path, f"w{i}", postgres, STUDY, N_TRIALS, hosts[i]) for i in range(3)]
    try:
        victim = f"{hosts[2] or socket.gethostname()}:{procs[2].pid}"
        killed = _kill_mid_trial(procs[2], victim, STUDY, postgres, tmp_path / "w2.err")
        for p in procs[:2]:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = [(tmp_path / f"w{i}.out").read_text() for i in range(3)]
    err = [(tmp_path / f"w{i}.err").read_text() for i in range(3)]
    assert [p.returncode for p in procs] == [0, 0, -signal.SIGKILL], err

    # every trial accounted for: the budget finished, the killed worker's trial failed by its stale heartbeat, and any
    # other failed trial one that found the budget taken and ran nothing
    storage = workers.open_storage(postgres)
    study = optuna.load_study(study_name=STUDY, storage=storage)
    trials = study.get_trials()
    assert finished(study) == N_TRIALS
    assert {t.state for t in trials} <= {TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL}
    dead = trials[killed]
    assert dead.state == TrialState.FAIL and dead.user_attrs["worker"] == victim and "not_run" not in dead.user_attrs
    if own_hosts:  # from another host only the heartbeat tells: failed no sooner than stale_after_s after the last one
        assert dead.datetime_complete.timestamp() - dead.user_attrs["alive_at"] >= 5
    assert all("not_run" in t.user_attrs for t in trials if t.state == TrialState.FAIL and t.number != killed)
    assert "".join(err).count("calibrating:") == 1, err  # calibrated once for the three
    assert sum("best draft" in o for o in out) == 1 and not out[2], out
    drafts = [p for i in range(3) if (p := tmp_path / f"w{i}" / "plans" / f"{STUDY}.json").exists()]
    assert len(drafts) == 1, drafts
    # what stays in the database: the study, and the killed worker's slot (cleared by the next worker to start)
    assert set(optuna.get_all_study_names(storage)) - {STUDY} <= {f"{STUDY}~worker-{i}" for i in range(3)}

    # one worker on the same trials (the same parameters, in the same order, with the same calibration and cost
    # model) picks the same draft
    one = optuna.create_study(study_name="pg-one", storage=storage, direction="maximize")
    for key, value in study.user_attrs.items():
        if key != "draft_written":
            one.set_user_attr(key, value)
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    for t in done:
        one.enqueue_trial(t.params)
    alone = _worker(tmp_path, "one", postgres, "pg-one", len(done), None)
    assert alone.wait(timeout=300) == 0, (tmp_path / "one.err").read_text()
    err_one = (tmp_path / "one.err").read_text()
    assert "calibrating" not in err_one and "measuring the cost model" not in err_one, err_one
    one = optuna.load_study(study_name="pg-one", storage=storage)
    assert _outcomes(one) == _outcomes(study)
    assert one.best_value == study.best_value
    best, best_one = DraftSpec.load(drafts[0]), DraftSpec.load(tmp_path / "one" / "plans" / "pg-one.json")
    assert best_one.key == best.key, (best_one.describe(), best.describe())


def test_liveness_settings_are_checked():
    from selfspec import SelfSpecError
    from selfspec.search.settings import SearchSettings
    from selfspec.typed import typed

    s = typed(SearchSettings, {"liveness": {"heartbeat_s": 0.5, "stale_after_s": 5}}, "search")
    assert s.liveness == workers.Liveness(0.5, 5.0)
    with pytest.raises(SelfSpecError, match="at least twice heartbeat_s"):
        workers.Liveness(heartbeat_s=10, stale_after_s=15)
    with pytest.raises(SelfSpecError, match="heartbeat_s must be a number > 0"):
        workers.Liveness(heartbeat_s=0)


def test_a_holder_on_another_host_is_judged_by_its_own_heartbeat(tmp_path):
    """A claim held past stale_after_s stays held while its heartbeat goes on; a silent one is taken over."""
    storage = workers.open_storage(tmp_path / "s.db")
    live = workers.Liveness(heartbeat_s=0.2, stale_after_s=1.0)
    elsewhere = {"worker": "another-host:1", "stale_after": 1.0}
    with workers.holding(storage, "x", "calibration", live) as mine:
        assert mine
        marker = optuna.load_study(study_name="x~calibration", storage=storage)
        marker.set_user_attr("worker", elsewhere["worker"])  # as if held from another host
        time.sleep(2.5)
        assert not workers.try_claim(storage, "x", "calibration")  # 2.5 s held, and its heartbeat is fresh
    assert optuna.get_all_study_names(storage) == []  # given back
    assert workers.try_claim(storage, "x", "calibration", live)
    marker = optuna.load_study(study_name="x~calibration", storage=storage)
    for key, value in elsewhere.items():  # held from another host, without a heartbeat (try_claim keeps none)
        marker.set_user_attr(key, value)
    assert not workers.try_claim(storage, "x", "calibration")
    time.sleep(1.2)
    assert workers.try_claim(storage, "x", "calibration")  # silent for its own stale_after: taken over
    # judged by what the holder recorded, not by the judge's setting
    now = time.time()
    assert workers._holder_alive({"worker": "another-host:1", "alive_at": now - 10, "stale_after": 30})
    assert not workers._holder_alive({"worker": "another-host:1", "alive_at": now - 10, "stale_after": 5}, 1e9)
    assert workers._holder_alive({"worker": "another-host:1", "alive_at": now - 10})  # none recorded: the default


def test_a_worker_waits_for_a_held_claim_and_takes_it_once_its_holder_lets_go(tmp_path):
    """The draft's writer: a worker that finds the claim held by a live worker waits for it instead of leaving (two
    that both left wrote no draft), and takes it when it is given back."""
    storage = workers.open_storage(tmp_path / "s.db")
    live = workers.Liveness(heartbeat_s=0.2, stale_after_s=1.0)
    taken: list[float] = []

    def wait() -> None:
        with workers.waiting(storage, "x", "writing the draft", live, poll_s=0.1):
            taken.append(time.time())

    with workers.holding(storage, "x", "writing the draft", live) as mine:
        assert mine
        marker = optuna.load_study(study_name="x~writing the draft", storage=storage)
        marker.set_user_attr("worker", "another-host:1")  # as if held from another host, its heartbeat fresh
        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(1.5)  # past the holder's stale_after: judged alive by its heartbeat
        assert not taken
        let_go = time.time()
    waiter.join(timeout=30)
    assert taken and taken[0] >= let_go
    assert optuna.get_all_study_names(storage) == []  # given back by the waiter too


def test_workers_opening_a_new_database_at_once_all_get_in(postgres):
    """The first workers on an empty database create Optuna's tables at the same moment: the losers of that race
    open the storage on a second try instead of failing."""
    start = time.time() + 5  # all open it at this instant, past their imports
    code = (f"import time; from selfspec.search import workers; time.sleep(max(0.0, {start} - time.time())); "
            f"workers.open_storage({postgres!r}); print('opened')")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [e[-1500:] for _, e in outs if e]
