"""Shared fixtures for the weightsync suite."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import pytest

from rlfleet.weightsync import process_alive
from rlfleet.weightsync.shm._shm import segment_creator


def _ours_or_stale(path: str) -> bool:
    """A segment this test process made, or one whose creator is dead (a leak either way).

    Segments of other live processes (a concurrent test run on a shared machine) are not this
    test's business. Names without a creator in them (not made by `SharedSegment`) cannot be
    attributed: they count under CI, where nothing else runs, and are ignored elsewhere.
    """
    creator = segment_creator(os.path.basename(path))
    if creator is None:
        return bool(os.environ.get("CI"))
    pid, start = creator
    return pid == os.getpid() or not process_alive(pid, start)


@pytest.fixture(autouse=True)
def no_leaked_segments() -> Iterator[None]:
    """Every test leaves /dev/shm as it found it: no rlfleet segment of ours left behind."""
    before = set(glob.glob("/dev/shm/rlfleet*"))
    yield
    leaked = {p for p in set(glob.glob("/dev/shm/rlfleet*")) - before if _ours_or_stale(p)}
    assert not leaked, f"leaked shared-memory segments: {sorted(leaked)}"
