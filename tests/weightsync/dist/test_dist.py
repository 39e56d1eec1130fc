"""torch.distributed broadcast sync over real gloo, across spawned processes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import Layout, MetadataError, checksum
from rlfleet.weightsync.protocol._wire import CONTROL_BYTES, HEADER_BYTES, Control, Header, bucket_segments


# -- protocol pieces (no processes) ------------------------------------------------------------
def test_header_and_control_round_trip() -> None:
    header = Header(7, "ab" * 32, 12, True, 1234, 4096, None)
    raw = header.encode()
    assert len(raw) == HEADER_BYTES
    assert Header.decode(raw) == header
    aborted = Header(7, "x", 0, abort="parameter 'w' missing" * 500)
    assert Header.decode(aborted.encode()).abort is not None
    control = Control(3, 999, 0xDEADBEEF, None)
    assert Control.decode(control.encode()) == control
    assert len(control.encode()) == CONTROL_BYTES
    long_reason = Control(1, 0, None, "x" * 5000)
    assert len(Control.decode(long_reason.encode()).abort or "") <= 300


@pytest.mark.parametrize(
    "raw",
    [
        b"\0" * HEADER_BYTES,
        b'{"magic":"nope"}'.ljust(HEADER_BYTES, b"\0"),
        b"[1,2]".ljust(HEADER_BYTES, b"\0"),
        b'{"magic":"rlfleet-weightsync","protocol":1,"version":1,"digest":"d","buckets":-1,'
        b'"checksums":false,"layout_nbytes":0,"direct_min":1,"abort":null}'.ljust(HEADER_BYTES, b"\0"),
        b"\xff\xfe".ljust(HEADER_BYTES, b"\0"),
        b"{}",
    ],
)
def test_malformed_header_is_a_metadata_error(raw: bytes) -> None:
    with pytest.raises(MetadataError):
        Header.decode(raw)


def test_control_rejects_bad_crc() -> None:
    raw = b'{"bucket":0,"nbytes":1,"crc":-5,"abort":null}'.ljust(CONTROL_BYTES, b"\0")
    with pytest.raises(MetadataError, match="crc"):
        Control.decode(raw)


def test_segments_cover_every_tensor_once() -> None:
    sd = w.make_state(1)
    layout = w.layout_of(sd)
    for bucket in layout.buckets:
        segs = bucket_segments(layout, bucket.index, w.DIRECT_MIN)
        for spec in bucket.tensors:
            if spec.nbytes:
                inside = [s for s in segs if s.start <= spec.offset and spec.offset + spec.nbytes <= s.end]
                assert len(inside) == 1, spec.name
                if spec.nbytes >= w.DIRECT_MIN:
                    assert inside[0].tensor == spec.name
        assert all(a.end <= b.start for a, b in itertools.pairwise(segs))


# -- real gloo, real processes -----------------------------------------------------------------
@pytest.fixture(scope="module")
def protocol_run() -> dict[int, Any]:
    return w.run_ranks(w.scenario_protocol, 3, timeout=150.0)


def _expected(version: int) -> str:
    return checksum(w.make_state(version))


@pytest.mark.timeout(200)
def test_bit_exact_to_every_receiver(protocol_run: dict[int, Any]) -> None:
    sender = protocol_run[0]
    assert sender["v1"]["ok"], sender["v1"]
    assert sender["v2"]["ok"], sender["v2"]  # with crc32 per bucket
    for rank in (1, 2):
        for step, version in (("v1", 1), ("v2", 2)):
            got = protocol_run[rank][step]
            assert got["ok"], got
            assert got["applied"] == version
            assert got["checksum"] == _expected(version)
    assert protocol_run[2]["landed"] > 0  # rank 2's large tensors landed in place (TensorTarget)
    # a sender whose tensors were adopted into one block sends its slices as they lie
    assert sender["adopted_in_block"] is True
    assert sender["adopted"]["ok"], sender["adopted"]
    for rank in (1, 2):
        got = protocol_run[rank]["adopted"]
        assert got["ok"], got
        assert got["checksum"] == _expected(4)


@pytest.mark.timeout(200)
def test_stale_version_is_rejected_everywhere(protocol_run: dict[int, Any]) -> None:
    assert protocol_run[0]["stale"]["type"] == "VersionError"
    for rank in (1, 2):
        got = protocol_run[rank]["stale"]
        assert got["type"] == "VersionError"
        assert got["checksum"] == _expected(2)


@pytest.mark.timeout(200)
def test_layout_mismatch_names_the_parameter_and_applies_nothing(protocol_run: dict[int, Any]) -> None:
    mismatched = protocol_run[2]["layout"]
    assert mismatched["type"] == "LayoutMismatchError"
    assert mismatched["parameter"] == "layers.7.w"
    assert "layers.7.w" in mismatched["message"]
    assert protocol_run[0]["layout"]["type"] == "LayoutMismatchError"
    assert "rank 2" in protocol_run[0]["layout"]["message"]
    other = protocol_run[1]["layout"]
    assert other["type"] == "SyncAbortedError"
    assert "rank 2" in other["message"]
    for rank in (1, 2):
        assert protocol_run[rank]["layout"]["applied"] == 2
        assert protocol_run[rank]["layout"]["checksum"] == _expected(2)


@pytest.mark.timeout(200)
def test_one_failing_receiver_aborts_the_version_on_all(protocol_run: dict[int, Any]) -> None:
    assert protocol_run[0]["consumer"]["type"] == "SyncAbortedError"
    assert "rank 2" in protocol_run[0]["consumer"]["message"]
    assert "injected consumer failure" in protocol_run[2]["consumer"]["message"]
    assert protocol_run[1]["consumer"]["type"] == "SyncAbortedError"
    for rank in (1, 2):
        assert protocol_run[rank]["consumer"]["applied"] == 2
        assert protocol_run[rank]["consumer"]["checksum"] == _expected(2)


@pytest.mark.timeout(200)
def test_sender_abort_mid_way_fails_receivers_fast(protocol_run: dict[int, Any]) -> None:
    assert protocol_run[0]["midway"]["type"] == "SyncAbortedError"
    for rank in (1, 2):
        got = protocol_run[rank]["midway"]
        assert got["type"] == "SyncAbortedError"
        assert "injected failure" in got["message"]
        assert got["applied"] == 2
        assert got["checksum"] == _expected(2)


@pytest.mark.timeout(200)
def test_sender_layout_problem_is_announced_in_the_header(protocol_run: dict[int, Any]) -> None:
    sent = protocol_run[0]["upfront"]
    assert sent["type"] == "LayoutMismatchError"
    assert sent["parameter"] == "layers.50.w"
    for rank in (1, 2):
        got = protocol_run[rank]["upfront"]
        assert got["type"] == "SyncAbortedError"
        assert "layers.50.w" in got["message"]
        assert got["checksum"] == _expected(2)


@pytest.mark.timeout(200)
def test_group_stays_usable_after_clean_failures(protocol_run: dict[int, Any]) -> None:
    assert protocol_run[0]["v3"]["ok"], protocol_run[0]["v3"]
    assert protocol_run[0]["broken"] is None
    for rank in (1, 2):
        got = protocol_run[rank]["v3"]
        assert got["ok"], got
        assert got["applied"] == 3
        assert got["checksum"] == _expected(3)
        assert protocol_run[rank]["broken"] is None
        assert protocol_run[rank]["aborts"] >= 2  # consumer and midway aborts reached the consumer


@pytest.mark.timeout(120)
def test_sender_killed_mid_sync() -> None:
    results = w.run_ranks(w.scenario_kill, 3, timeout=90.0, expect_dead=(0,))
    for rank in (1, 2):
        got = results[rank]
        assert got["type"] in ("PeerLostError", "SyncTimeoutError"), got
        assert got["seconds"] < 20.0 + 5.0
        assert got["applied"] == 1
        assert got["checksum"] == _expected(1)
        assert got["aborts"] == 1
        assert got["again"]["type"] == "SyncAbortedError"  # a broken group is not reused silently
        assert "rebuild" in got["again"]["message"]


@pytest.mark.timeout(120)
def test_bounded_group_creation_names_missing_ranks() -> None:
    results = w.run_ranks(w.scenario_rendezvous, 3, w.FreshPort(), w.FreshPort(), timeout=90.0)
    for rank in (0, 1):
        got = results[rank]["no_rank2"]
        assert got["type"] == "RendezvousTimeoutError", got
        assert got["missing"] == [2]
        assert "rank(s) [2]" in got["message"]
        grp = results[rank]["group_no_rank2"]
        assert grp["type"] == "RendezvousTimeoutError", grp
        assert grp["missing"] == [2]
    for rank in (1, 2):
        got = results[rank]["no_rank0"]
        assert got["type"] == "RendezvousTimeoutError", got
        assert got["missing"] == [0]
    assert results[2]["subgroup_checksum"] == _expected(5)


def test_layout_for_tests_has_both_segment_kinds() -> None:
    layout: Layout = w.layout_of(w.make_state(0))
    kinds = {s.tensor is None for b in layout.buckets for s in bucket_segments(layout, b.index, w.DIRECT_MIN)}
    assert kinds == {True, False}
    assert any(b.nbytes > w.BUCKET for b in layout.buckets)
    assert torch.float8_e4m3fn in {t.torch_dtype for t in layout.tensors}
