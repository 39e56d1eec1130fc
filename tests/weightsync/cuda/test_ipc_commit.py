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


@pytest.mark.timeout(200)
def test_a_writer_frees_the_slots_of_failed_versions_once_no_reader_maps_them(tmp_path: Path) -> None:
    """Three versions fail on the writer while its reader still reads a slot (closed with the
    slots still mapped, so they are not freed then); once the reader left each channel, the
    writer holds no slot of them: none counted, none still mapped in the process."""
    results = w.run_ranks(icw.scenario_ipc_writer_slots, 2, str(tmp_path / "channel"), timeout=180.0)
    writer, reader = results[0], results[1]
    for attempt in range(icw.FAILURES):
        assert writer[f"send{attempt}"]["type"] == "SyncTimeoutError", writer[f"send{attempt}"]
        assert not reader[f"receive{attempt}"]["ok"], reader[f"receive{attempt}"]
    assert writer["mapped"] == 0, f"{writer['mapped']} failed channels' slots are still mapped"
    assert writer["held"] == 0
    assert writer["ok"]["ok"], writer["ok"]
    assert reader["ok"]["ok"], reader["ok"]
    assert reader["checksum"] == _expected(2)
    assert (writer["held_after_close"], writer["mapped_after_close"]) == (0, 0)
