"""Landing targets of DirectBuffer / DoubleBuffer: a broadcast writes straight into their storage.

In-process checks of the target contract (only while a version is pending, landed tensors not
overwritten by ``consume``, memory accounting), then real gloo processes: bit-exact receives
into every buffer kind, proof that the transport used the targets, and a corrupted bucket, a
sender failing midway and a sender killed mid-sync all leaving the applied version intact
(the in-place "None" buffer, not atomic by contract, reports itself torn instead).
"""

from __future__ import annotations

from typing import Any

import landing_workers as lw
import pytest
import torch
import weightsync_dist_workers as dw

from rlfleet.weightsync import BucketTarget, DirectBuffer, DoubleBuffer, TensorTarget, checksum, pack_bucket
from rlfleet.weightsync.layout._packing import typed_view

ATOMIC = ("direct-atomic", "double-copy", "double-swap")


def _layout() -> Any:
    return dw.layout_of(lw.landing_state(0))


def _targets_closed(buffer: Any) -> bool:
    return buffer.bucket_target(0) is None and all(buffer.tensor_target(n) is None for n in lw.LANDABLE)


# -- in process: the contract ------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(lw.KINDS.values()))
def test_targets_exist_only_while_a_version_is_pending(kind: str) -> None:
    layout = _layout()
    buffer = lw.make_buffer(kind, lw.receiver_live(), layout)
    assert isinstance(buffer, BucketTarget)
    assert isinstance(buffer, TensorTarget)
    assert _targets_closed(buffer)
    buffer.begin(1)
    if kind in ("direct-atomic", "double-copy"):
        assert all(buffer.bucket_target(b.index) is not None for b in layout.buckets)
        assert buffer.bucket_target(len(layout.buckets)) is None
    else:
        assert buffer.bucket_target(0) is None
        assert all(buffer.tensor_target(n) is not None for n in lw.LANDABLE)
        assert buffer.tensor_target("transposed") is None, "non-contiguous storage is no target"
        assert buffer.tensor_target("no.such.tensor") is None
    buffer.abort(RuntimeError("test"))
    assert _targets_closed(buffer)
    assert buffer.version == -1


@pytest.mark.parametrize("kind", sorted(lw.KINDS.values()))
def test_consume_keeps_a_landed_tensor_and_takes_the_rest_from_the_bucket(kind: str) -> None:
    """Landed tensors: the bucket holds unspecified bytes for them, which must not be copied."""
    layout = _layout()
    live = lw.receiver_live()
    buffer = lw.make_buffer(kind, live, layout)
    state = lw.landing_state(1)
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    buffer.begin(1)
    for bucket in layout.buckets:
        region = buffer.bucket_target(bucket.index)
        if region is not None:  # land the whole bucket, as the wire does
            pack_bucket(layout, bucket.index, state, region)
            buffer.consume(bucket.index, region)
            continue
        data = pack_bucket(layout, bucket.index, state, scratch)
        for spec in bucket.tensors:
            target = buffer.tensor_target(spec.name) if spec.name in lw.LANDABLE else None
            if target is not None:
                target.copy_(state[spec.name])
                typed_view(data, spec).view(torch.uint8).fill_(0xA5)  # garbage in the bucket
        buffer.consume(bucket.index, data)
    buffer.commit(1)
    assert checksum(buffer.live) == checksum(state)
    assert _targets_closed(buffer)


def test_memory_accounting_stays_honest() -> None:
    layout = _layout()
    direct = DirectBuffer(lw.receiver_live(), layout)
    direct.begin(1)
    assert direct.extra_bytes == layout.padded_bytes  # the landing zone is the transient staging
    direct.abort(RuntimeError("test"))
    assert direct.extra_bytes == 0
    assert direct.peak_extra_bytes == layout.padded_bytes
    in_place = DirectBuffer(lw.receiver_live(), layout, max_staging_bytes=0)
    in_place.begin(1)
    assert in_place.tensor_target("embed.weight") is not None
    assert in_place.torn, "a live tensor handed to the transport is reported at once"
    assert in_place.extra_bytes == 0
    assert in_place.peak_extra_bytes == 0
    copy = DoubleBuffer(lw.receiver_live(), layout)
    assert copy.extra_bytes == layout.padded_bytes  # one flat staging buffer, allocated once
    swap = DoubleBuffer(lw.receiver_live(), layout, mode="swap")
    assert swap.extra_bytes == sum(t.untyped_storage().nbytes() for t in swap.live.values())


# -- real gloo ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def landing_run() -> dict[int, Any]:
    return dw.run_ranks(lw.scenario_landing, 1 + len(lw.KINDS), timeout=200.0)


def _expected(version: int) -> str:
    return checksum(lw.landing_state(version))


@pytest.mark.timeout(260)
@pytest.mark.parametrize("rank", sorted(lw.KINDS))
def test_bit_exact_into_every_buffer_through_its_targets(landing_run: dict[int, Any], rank: int) -> None:
    sender, got = landing_run[0], landing_run[rank]
    assert not got["transposed_live_contiguous"]
    for step, version in (("v1", 1), ("v2", 2), ("v5", 5)):  # v2, v5: with crc32 per bucket
        assert sender[step]["ok"], sender[step]
        result = got[step]
        assert result["ok"], result
        assert result["applied"] == version
        assert result["checksum"] == _expected(version), f"{got['kind']} {step}"
        assert not result["torn"]
        assert result["outside"] == [True, True], "targets handed out after commit"
        ev = result["evidence"]
        assert ev["targets_are_final"], ev
        if got["kind"] in ("direct-atomic", "double-copy"):
            everything = list(range(ev["buckets"]))
            assert ev["bucket_targets"] == everything
            assert ev["landed_buckets"] == everything, "the wire received into a bucket buffer instead"
        else:
            assert set(ev["tensor_targets"]) == lw.LANDABLE, "every large contiguous tensor landed"


@pytest.mark.timeout(260)
@pytest.mark.parametrize("rank", sorted(lw.KINDS))
def test_corrupted_bucket_and_failed_sender_leave_the_applied_version(
    landing_run: dict[int, Any], rank: int
) -> None:
    sender, got = landing_run[0], landing_run[rank]
    assert sender["corrupt"]["type"] == "SyncAbortedError", sender["corrupt"]
    assert got["corrupt"]["type"] == "ChecksumMismatchError", got["corrupt"]
    assert sender["midway"]["type"] == "SyncAbortedError", sender["midway"]
    assert got["midway"]["type"] == "SyncAbortedError", got["midway"]
    for step in ("corrupt", "midway"):
        result = got[step]
        assert result["applied"] == 2
        assert result["outside"] == [True, True]
        if got["kind"] in ATOMIC:
            assert result["checksum"] == _expected(2), f"{got['kind']}: {step} touched the live weights"
            assert not result["torn"]
        else:  # in place: not atomic by contract, and it says so
            assert result["torn"]
    assert got["broken"] is None
    assert got["v5"]["checksum"] == _expected(5)  # and the next sync lands whole


@pytest.mark.timeout(120)
def test_sender_killed_mid_sync_leaves_the_applied_version() -> None:
    results = dw.run_ranks(lw.scenario_sender_dies, 1 + len(lw.KINDS), timeout=90.0, expect_dead=(0,))
    for rank in lw.KINDS:
        got = results[rank]
        assert not got["ok"], got
        assert got["type"] in ("PeerLostError", "SyncTimeoutError"), got
        assert got["applied"] == 1
        assert got["handed_out"] > 0, "the first buckets had landed before the sender died"
        assert got["outside"] == [True, True]
        if got["kind"] in ATOMIC:
            assert got["checksum"] == _expected(1), f"{got['kind']}: live weights touched"
            assert not got["torn"]
        else:
            assert got["torn"]
