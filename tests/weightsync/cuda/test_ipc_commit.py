"""The CUDA IPC channel's two-phase commit and slot lifetimes, across real processes, over host
slots (``backend="host"``: the channel's state machine without a GPU)."""

from __future__ import annotations

from pathlib import Path

import ipc_commit_workers as icw
import pytest
import weightsync_dist_workers as w

from rlfleet.weightsync import checksum


def _expected(version: int) -> str:
    return checksum(w.make_state(version))


@pytest.mark.timeout(200)
def test_a_reader_that_cannot_commit_votes_no_and_no_reader_applies_the_version(tmp_path: Path) -> None:
    """Reader 2 cannot commit version 2 (a request holds its serving lock past the commit
    timeout): it prepares before it votes, so it votes no, the sender reports the failure
    naming it, reader 1 keeps version 1 too, and version 3 goes through on both."""
    results = w.run_ranks(icw.scenario_ipc_commit_fails, 3, str(tmp_path / "channel"), timeout=180.0)
    sender = results[0]
    assert sender["v1"]["ok"], sender["v1"]
    assert not sender["v2"]["ok"], "the sender reported a version a reader did not apply"
    assert sender["v2"]["type"] == "SyncAbortedError", sender["v2"]
    assert "reader(s) [1]" in sender["v2"]["message"]
    assert sender["v3"]["ok"], sender["v3"]
    stuck = results[2]["v2"]
    assert stuck["type"] == "SyncTimeoutError", stuck
    assert "in-flight requests" in stuck["message"]
    assert results[1]["v2"]["type"] == "SyncAbortedError", results[1]["v2"]
    for rank in (1, 2):
        got = results[rank]
        assert (got["v1"]["applied"], got["v1"]["checksum"]) == (1, _expected(1))
        assert (got["v2"]["applied"], got["v2"]["checksum"]) == (1, _expected(1)), (rank, got["v2"])
        assert got["v2"]["pending"] is None  # what the prepare took was released
        assert got["v3"]["ok"], (rank, got["v3"])
        assert (got["v3"]["applied"], got["v3"]["checksum"]) == (3, _expected(3))
