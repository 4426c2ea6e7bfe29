"""Search workers on one storage: running trials, slots, claims, storage URLs and Ctrl-C."""

import os
import signal
import socket
import subprocess
import sys
import time

import optuna
import pytest

from selfspec import SelfSpecError
from selfspec.search import workers
from selfspec.search.study import open_study


def test_an_unmarked_running_trial_lives_while_another_worker_does(tmp_path):
    """A trial asked but not yet marked by its worker counts as running only while another worker lives."""
    storage = workers.open_storage(tmp_path / "s.db")
    study = optuna.create_study(study_name="x", storage=storage)
    study.ask()
    assert workers.running_elsewhere(study) == 0  # no other worker: its asker is gone
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with workers.worker_slot(storage, "x"):
            optuna.load_study(study_name="x~worker-0", storage=storage).set_user_attr(
                "worker", f"{socket.gethostname()}:{sleeper.pid}")
            assert workers.running_elsewhere(study) == 1 and workers.fail_dead_trials(study) == 0
    finally:
        sleeper.kill()
        sleeper.wait()
    optuna.create_study(study_name="x~worker-0", storage=storage).set_user_attr(
        "worker", f"{socket.gethostname()}:{sleeper.pid}")  # a slot its killed holder never gave back
    assert workers.fail_dead_trials(study) == 1 and workers.running_elsewhere(study) == 0


def test_worker_slots_are_distinct_and_given_back(tmp_path):
    storage = workers.open_storage(tmp_path / "s.journal")
    with workers.worker_slot(storage, "x") as a, workers.worker_slot(storage, "x") as b:
        assert (a, b) == (0, 1)
    with workers.worker_slot(storage, "x") as c:
        assert c == 0


def test_a_claim_is_computed_once_and_a_dead_holder_is_taken_over(tmp_path):
    storage = workers.open_storage(tmp_path / "s.db")
    box = {}
    calls = []

    def compute():
        calls.append(1)
        box["v"] = 42
        return 42

    assert workers.claimed_once(storage, "x", "c", lambda: box.get("v"), compute) == 42
    assert workers.claimed_once(storage, "x", "c", lambda: box.get("v"), compute) == 42 and len(calls) == 1
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert workers.try_claim(storage, "x", "d")
    optuna.load_study(study_name="x~d", storage=storage).set_user_attr("worker", f"{socket.gethostname()}:{int(gone.stdout)}")
    assert workers.try_claim(storage, "x", "d")  # its holder is dead: taken over
    assert not workers.try_claim(storage, "x", "d")  # held by this live process


def test_storage_urls_and_bad_ones(tmp_path):
    url = f"sqlite:///{tmp_path}/u.db"
    study = open_study(url, "x", "m", "random", 0)
    assert study.study_name == "x" and (tmp_path / "u.db").is_file()
    with pytest.raises(SelfSpecError, match="cannot open the study storage nosuchdriver://"):
        workers.open_storage("nosuchdriver://host/db")


def test_ctrl_c_is_held_until_the_trial_is_told():
    from selfspec.search.study import ctrl_c_between_trials

    # as in a terminal; a test run started in the background (CI) ignores SIGINT: set it as Python does
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with ctrl_c_between_trials() as check:
            check()  # nothing pending
            os.kill(os.getpid(), signal.SIGINT)  # held: no KeyboardInterrupt here ...
            time.sleep(0.05)
            with pytest.raises(KeyboardInterrupt):
                check()  # ... but at the next check
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C: at once
                time.sleep(1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with ctrl_c_between_trials() as check:  # a process that ignores SIGINT keeps ignoring it
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, outer)
