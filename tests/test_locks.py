"""Folders checked for writing by several processes at once."""

import multiprocessing
import pathlib

from selfspec import SelfSpecError
from selfspec.locks import check_writable


def test_check_writable_from_several_processes_at_once(tmp_path):
    """Workers sharing a folder check it at the same moment: no one's probe removes another's."""
    with multiprocessing.get_context("fork").Pool(4) as pool:
        errors = pool.map(_check_many, [str(tmp_path / "shared")] * 4)
    assert errors == [None] * 4
    assert list((tmp_path / "shared").iterdir()) == []  # no probe left behind


def _check_many(folder: str) -> str | None:
    try:
        for _ in range(300):
            check_writable(pathlib.Path(folder), "probes")
    except SelfSpecError as e:
        return str(e)
    return None
