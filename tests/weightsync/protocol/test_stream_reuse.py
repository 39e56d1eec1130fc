"""A stream whose producer reuses one buffer for every tensor: each transport consumes (or copies)
a tensor before it asks for the next, so every receiver gets the producer's values bit-exact
(broadcast, ShmRing, SharedBuffer.publish, CUDA IPC in host mode, and `feed`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import reuse_workers as r
import shm_workers as shm
import streaming_workers as s
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    DoubleBuffer,
    SharedBuffer,
    SharedBufferReader,
    ShmRingSender,
    checksum,
    feed,
)


def _expected(version: int) -> str:
    return checksum(w.make_state(version))


def test_the_producer_really_reuses_its_buffer() -> None:
    pairs = list(r.reusing(r.layout(), w.make_state(1)))
    pointers = {t.untyped_storage().data_ptr() for _, t in pairs}
    assert len(pointers) == 1  # every tensor is the same memory: only the last one's bytes are left


@pytest.mark.timeout(200)
def test_broadcast_sends_each_tensor_of_a_reusing_stream_bit_exact() -> None:
    results = w.run_ranks(r.scenario_reuse_broadcast, 3, timeout=180.0)
    for version in r.VERSIONS:
        assert results[0][f"v{version}"]["ok"], results[0]
        for rank in (1, 2):
            got = results[rank][f"v{version}"]
            assert got["ok"], (rank, got)
            assert got["checksum"] == _expected(version), (rank, version)


@pytest.mark.timeout(200)
def test_ring_sends_each_tensor_of_a_reusing_stream_bit_exact() -> None:
    queue = shm.context().Queue()
    with ShmRingSender(r.layout(), 1, checksums=True) as sender, shm.processes() as procs:
        shm.start(procs, s.ring_reader, sender.name, 0, r.BUCKET, len(r.VERSIONS), queue)
        for version in r.VERSIONS:
            assert sender.send(r.reusing(r.layout(), w.make_state(version)), version, shm.TIMEOUT) == {
                0: "committed"
            }
            _, ok, _, applied, total = queue.get(timeout=shm.TIMEOUT)
            assert (ok, applied, total) == (True, version, _expected(version))


def test_shared_buffer_publishes_a_reusing_stream_bit_exact() -> None:
    layout = r.layout()
    with SharedBuffer(layout, 1, checksums=True) as node, SharedBufferReader.attach(node.name) as reader:
        for version in r.VERSIONS:
            node.publish(r.reusing(layout, w.make_state(version)), version, 30.0)
            assert reader.refresh(30.0) == version
            assert checksum(reader.tensors()) == _expected(version)


def test_feed_takes_each_tensor_of_a_reusing_stream_bit_exact() -> None:
    layout = r.layout()
    buffer = DoubleBuffer({k: v.clone() for k, v in w.make_state(0).items()}, layout)
    for version in r.VERSIONS:
        feed(buffer, r.reusing(layout, w.make_state(version)), version, 30.0)
        assert checksum(buffer.live) == _expected(version)


@pytest.mark.timeout(200)
def test_cuda_ipc_host_mode_sends_each_tensor_of_a_reusing_stream_bit_exact(tmp_path: Path) -> None:
    results: dict[int, Any] = w.run_ranks(r.scenario_reuse_ipc, 3, str(tmp_path / "channel"), timeout=180.0)
    for version in r.VERSIONS:
        assert results[0][f"v{version}"]["ok"], results[0]
        for rank in (1, 2):
            got = results[rank][f"v{version}"]
            assert got["ok"], (rank, got)
            assert got["checksum"] == _expected(version), (rank, version)
