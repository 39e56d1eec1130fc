"""NCCL through CuPy: the glue against CuPy 13's and 14's signatures (a stand-in, since CuPy's
NCCL cannot run without a GPU), the rendezvous and bounded init across real processes, the
protocol's wire bytes over gloo, and the real communicator on a GPU."""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import weightsync_dist_workers as w
from cupy_nccl_standin import StandInNccl
from rendezvous_workers import scenario_nccl_standin
from torch._C._distributed_c10d import HashStore

from rlfleet.weightsync import (
    BroadcastSender,
    Deadline,
    Layout,
    MemberGroup,
    MetadataError,
    NcclSender,
    NcclWire,
    RendezvousTimeoutError,
    bucket_segments,
    checksum,
)
from rlfleet.weightsync.cuda._nccl import decode_unique_id, encode_unique_id, nccl_ranks
from rlfleet.weightsync.cuda._nccl_init import communicator, group_prefix, join_communicator
from rlfleet.weightsync.dist._rendezvous import join_generation

HAS_CUPY = importlib.util.find_spec("cupy") is not None
CUPYS = [(14, True), (13, True), (13, False)]  # (CuPy version, C char signed: x86-64 / aarch64)


def expected_wire_bytes(layout: Layout, direct_min: int) -> int:
    """What the protocol puts on the wire for `layout`: every segment of every bucket, as
    `bucket_segments` cuts them (a run of small tensors carries the alignment padding between
    them), so the figure follows the protocol's packing instead of restating it."""
    buckets = (bucket_segments(layout, k, direct_min) for k in range(len(layout.buckets)))
    return sum(segment.nbytes for segments in buckets for segment in segments)


def test_unique_id_round_trips_as_json() -> None:
    raw = os.urandom(128)
    assert decode_unique_id(encode_unique_id(raw)) == raw
    ints = tuple((i * 7) % 256 - 128 for i in range(128))
    assert decode_unique_id(encode_unique_id(ints)) == ints


@pytest.mark.parametrize(
    "text",
    ["", "[]", '{"b64": "AAAA"}', '{"ints": [1, 2]}', '{"ints": ["x"]}', '{"b64": "!!"}', "\xff"],
)
def test_malformed_unique_id_is_rejected(text: str) -> None:
    with pytest.raises((MetadataError, ValueError)):
        decode_unique_id(text)


def test_nccl_rank_of_a_member() -> None:
    assert nccl_ranks([4, 2, 9], 9) == 2
    with pytest.raises(ValueError, match="not among"):
        nccl_ranks([4, 2], 3)


@pytest.mark.parametrize(("drawn", "taken"), [(a, b) for a in CUPYS for b in CUPYS])
def test_communicator_takes_an_id_of_any_cupy_on_any_cupy(
    tmp_path: Path, drawn: tuple[int, bool], taken: tuple[int, bool]
) -> None:
    """An id drawn by one CuPy (and platform) reaches the other's NcclCommunicator byte for byte."""
    source = StandInNccl(drawn[0], tmp_path, char_signed=drawn[1])
    uid = source.get_unique_id()
    assert isinstance(uid, bytes if drawn[0] >= 14 else tuple)
    raw = uid if isinstance(uid, bytes) else bytes(x & 0xFF for x in uid)
    nccl = StandInNccl(taken[0], tmp_path, char_signed=taken[1])
    comm = communicator(nccl, 1, decode_unique_id(encode_unique_id(uid)), 0)
    assert comm.unique_id == raw


def test_the_stand_in_refuses_what_each_cupy_refuses(tmp_path: Path) -> None:
    """The signatures the glue must satisfy: 14 takes bytes only, 13 a tuple of in-range chars."""
    raw = bytes(range(128, 256))  # every byte above a signed char's range
    with pytest.raises(TypeError, match="expected bytes, got tuple"):
        StandInNccl(14, tmp_path).NcclCommunicator(1, tuple(raw), 0)  # the old glue, on CuPy 14
    with pytest.raises(ValueError, match="commId length 127"):
        StandInNccl(14, tmp_path).NcclCommunicator(1, raw[:127], 0)
    with pytest.raises(TypeError, match="expected tuple, got bytes"):
        StandInNccl(13, tmp_path).NcclCommunicator(1, raw, 0)
    with pytest.raises(OverflowError):
        StandInNccl(13, tmp_path, char_signed=True).NcclCommunicator(1, tuple(raw), 0)  # 128 > 127
    with pytest.raises(OverflowError):
        StandInNccl(13, tmp_path, char_signed=False).NcclCommunicator(1, (-1,) * 128, 0)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("version", [14, 13])
def test_rebuilding_a_group_on_the_same_store_and_name_never_reads_a_stale_id(
    tmp_path: Path, version: int
) -> None:
    results = w.run_ranks(scenario_nccl_standin, 3, version, str(tmp_path), timeout=120.0)
    firsts = {results[r]["first"] for r in range(3)}
    agains = {results[r]["again"] for r in range(3)}
    assert len(firsts) == 1, "every rank built the first communicator from the source's id"
    assert len(agains) == 1, "the late rank's stale check-in did not split the rebuild"
    assert firsts != agains, "the rebuild drew a fresh id"
    for rank in (0, 1):
        got = results[rank]["absent"]
        assert got["type"] == "RendezvousTimeoutError", got
        assert got["missing"] == [2], got
        assert got["seconds"] < 20.0, "named within the deadline, not after a hang"


@pytest.mark.timeout(60)
def test_a_communicator_init_is_bounded_and_names_who_never_came(tmp_path: Path) -> None:
    """Rank 1 joins the generation but never calls ncclCommInitRank: rank 0's init (which
    would wait forever) fails at its deadline naming rank 1; when rank 1 comes after all,
    the init rank 0 gave up on completes and aborts its communicator at once."""
    nccl = StandInNccl(14, tmp_path)
    store = HashStore()
    joined: dict[str, Any] = {}

    def rank1() -> None:
        joined["roster"] = join_generation(store, group_prefix("w"), 1, range(2), 30.0, "test", lead=0)

    thread = threading.Thread(target=rank1)
    thread.start()
    with pytest.raises(RendezvousTimeoutError, match="never reached ncclCommInitRank") as caught:
        join_communicator(nccl, store, "w", 0, 2, 0, Deadline(2.0))
    thread.join(30.0)
    assert caught.value.missing_ranks == (1,)
    late = communicator(nccl, 2, decode_unique_id(joined["roster"].payload), 1)
    assert not late.aborted
    end = time.monotonic() + 20.0
    while not any(c.rank == 0 and c.aborted for c in nccl.built) and time.monotonic() < end:
        time.sleep(0.01)
    assert any(c.rank == 0 and c.aborted for c in nccl.built), "the abandoned init aborted what it got"


@pytest.mark.timeout(60)
def test_wire_bytes_are_the_bucket_segments() -> None:
    """The same protocol over a one-member gloo group: `wire_bytes` counts what `bucket_segments`
    sends, padding inside runs included (the GPU test below asserts the same figure)."""
    group = MemberGroup.create(HashStore(), "wire-bytes", 0, 1, 30.0)
    sd = w.make_state(1)
    layout = w.layout_of(sd)
    stats = BroadcastSender(layout, group, 0, checksums=True, direct_min=w.DIRECT_MIN).send(sd, 1, 60.0)
    assert stats.wire_bytes == expected_wire_bytes(layout, w.DIRECT_MIN)
    assert stats.wire_bytes >= sum(t.nbytes for t in sd.values())


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here")
def test_without_cupy_the_error_names_the_extras() -> None:
    store = HashStore()
    with pytest.raises(ImportError, match=r"\[cuda12\].*\[cuda13\]"):
        NcclWire.create(store, 0, 1)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_CUPY, reason="needs CUDA and cupy")
def test_one_rank_communicator_runs_the_bucket_loop() -> None:  # pragma: no cover - GPU only
    """On a GPU: CuPy's real NcclCommunicator is built from our id (bytes on CuPy 14, a tuple
    on 13), the whole protocol runs over it (header, negotiation, buckets, commit) with
    checksums, `wire_bytes` is the bucket segments' figure, the sender's tensors are
    untouched, and a rebuild on the same store and name works (a fresh generation)."""
    store = HashStore()
    sd = {k: v.cuda() for k, v in w.make_state(1).items()}
    layout = w.layout_of(sd)
    for _ in range(2):
        wire = NcclWire.create(store, 0, 1, deadline=60.0)
        try:
            stats = NcclSender(layout, wire, checksums=True, direct_min=w.DIRECT_MIN).send(sd, 1, 60.0)
            assert stats.wire_bytes == expected_wire_bytes(layout, w.DIRECT_MIN)
            assert checksum(sd) == checksum(w.make_state(1))
        finally:
            wire.close()
