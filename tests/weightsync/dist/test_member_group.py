"""MemberGroup: groups built by their members alone, with no default group, over real gloo."""

from __future__ import annotations

import pytest
import torch.distributed as dist
import weightsync_dist_workers as w
from member_workers import (
    scenario_member_absent,
    scenario_member_kill,
    scenario_member_overlap,
    scenario_member_sync,
)

from rlfleet.weightsync import (
    BroadcastReceiver,
    MemberGroup,
    RendezvousTimeoutError,
    checksum,
    host_store,
)
from rlfleet.weightsync.dist._dist import MemberWire


def _expected(version: int) -> str:
    return checksum(w.make_state(version))


# -- arguments (no peers needed) ------------------------------------------------------------------
@pytest.fixture
def store() -> dist.TCPStore:
    return host_store("127.0.0.1", timeout_s=10.0)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"rank": 2, "size": 2}, "rank must be in"),
        ({"rank": -1, "size": 2}, "rank must be in"),
        ({"rank": 0, "size": 0}, "size must be"),
        ({"rank": 0, "size": 1, "backend": "mpi"}, "backend must be one of"),
        ({"rank": 0, "size": 1, "prefix": ""}, "prefix"),
        ({"rank": 0, "size": 1, "timeout_s": 0.0}, "timeout_s"),
    ],
)
def test_bad_arguments_are_named(store: dist.TCPStore, kwargs: dict[str, object], words: str) -> None:
    args: dict[str, object] = {"prefix": "bad", "timeout_s": 5.0, **kwargs}
    with pytest.raises(ValueError, match=words):
        MemberGroup.create(store, **args)  # type: ignore[arg-type]


def test_a_group_of_one_works_without_a_default_group(store: dist.TCPStore) -> None:
    assert not dist.is_initialized()
    group = MemberGroup.create(store, "solo", 0, 1, timeout_s=10.0)
    assert (group.rank, group.size, group.backend) == (0, 1, "gloo")
    assert group.process_group is not None
    wire = MemberWire(group, 0)
    assert (wire.rank, wire.size, wire.src, wire.device.type) == (0, 1, 0, "cpu")
    with pytest.raises(ValueError, match="source rank 1"):
        MemberWire(group, 1)
    layout = w.layout_of(w.make_state(0))
    with pytest.raises(ValueError, match="source rank 3"):
        BroadcastReceiver(layout, group, 3)


# -- real processes -------------------------------------------------------------------------------
@pytest.mark.timeout(150)
def test_three_processes_sync_bit_exact_without_init_process_group() -> None:
    results = w.run_ranks(scenario_member_sync, 3, timeout=120.0)
    assert results[0]["v1"] == 1
    assert results[0]["v2"] == 2
    for rank in range(3):
        assert results[rank]["initialized"] is False
        assert results[rank]["member"] == 2 - rank
    for rank in (1, 2):  # DoubleBuffer, DirectBuffer
        for version in (1, 2):
            got = results[rank][f"v{version}"]
            assert got["applied"] == version
            assert got["checksum"] == _expected(version)


@pytest.mark.timeout(150)
def test_overlapping_groups_created_in_different_orders() -> None:
    results = w.run_ranks(scenario_member_overlap, 3, timeout=120.0)
    assert results[1]["a"] == _expected(7)
    assert results[2]["b"] == _expected(7)
    assert results[2]["version"] == 7


@pytest.mark.timeout(120)
def test_a_member_that_never_joins_is_named() -> None:
    results = w.run_ranks(scenario_member_absent, 3, timeout=90.0)
    for rank in (0, 1):
        got = results[rank]["absent"]
        assert got["type"] == "RendezvousTimeoutError", got
        assert got["missing"] == [2]
        assert "rank(s) [2]" in got["message"]
        assert "'absent'" in got["message"]
        assert results[rank]["seconds"] < 2.0 + 20.0  # bounded by timeout_s, not by gloo's connect
    assert issubclass(RendezvousTimeoutError, TimeoutError)


@pytest.mark.timeout(120)
def test_peer_killed_mid_sync_fails_the_survivors_within_the_deadline() -> None:
    results = w.run_ranks(scenario_member_kill, 3, timeout=90.0, expect_dead=(1,))
    for rank in (0, 2):
        got = results[rank]
        assert got["type"] in ("PeerLostError", "SyncTimeoutError"), got
        assert got["seconds"] < 20.0 + 5.0
        assert got["applied"] == 1
        assert got["checksum"] == _expected(1)
        assert got["again"]["type"] == "SyncAbortedError"
        assert "rebuild" in got["again"]["message"]
