"""CUDA IPC channel: the control plane across real processes (host slots), and on a GPU."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import weightsync_dist_workers as w
from ipc_workers import scenario_ipc_kept_while_mapped, scenario_ipc_settle, scenario_ipc_straggler

from rlfleet.weightsync import (
    CudaIpcReceiver,
    CudaIpcSender,
    MetadataError,
    SharedBuffer,
    ShmRingSender,
    checksum,
)
from rlfleet.weightsync.cuda._cuda_ipc import IPC, ChannelBlock, _decode_meta
from rlfleet.weightsync.cuda._ipc_control import (
    G_META_OFFSET,
    G_READERS,
    NUM_SLOTS,
    READER_WORDS,
    SLOT_BASE,
    SLOT_WORDS,
)
from rlfleet.weightsync.shm._shm import cleanup_stale_segments


@pytest.fixture(autouse=True)
def _reap_killed_creators() -> Iterator[None]:
    yield
    for prefix in ("rlfleet", "rlfleet-ipc", "rlfleet-ipcslots"):  # processes the tests SIGKILLed
        cleanup_stale_segments(prefix)


def _expected(version: int) -> str:
    return checksum(w.make_state(version))


def test_importing_the_package_does_not_import_cupy() -> None:
    code = "import sys, rlfleet.weightsync as ws; ws.CudaIpcSender; ws.NcclWire; print('cupy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(
    _has_cupy := __import__("importlib").util.find_spec("cupy") is not None, reason="cupy present"
)
def test_cuda_backend_without_cupy_names_the_extras() -> None:
    layout = w.layout_of(w.make_state(0))
    with pytest.raises(ImportError, match=r"rlfleet-weightsync\[cuda12\]"):
        CudaIpcSender(layout, 1, backend="cuda")


@pytest.mark.parametrize(
    "meta",
    [
        b"not json",
        b"[]",
        b'{"backend":"tcp","handles":[],"slot_bytes":1}',
        b'{"backend":"cuda","handles":["a"],"slot_bytes":1}',
        b'{"backend":"host","handles":["x"],"slot_bytes":-1}',
        b'{"backend":"host","handles":["x"],"slot_bytes":512,"layout":{"format":99}}',
    ],
)
def test_malformed_channel_metadata_is_rejected(meta: bytes) -> None:
    with pytest.raises(MetadataError):
        _decode_meta(meta)


def test_attach_to_something_else_fails_clearly() -> None:
    from rlfleet.weightsync.shm._shm import SharedSegment

    with SharedSegment.create(4096) as seg, pytest.raises(MetadataError, match="not an rlfleet IPC channel"):
        CudaIpcReceiver.attach(seg.name, 0)


def test_control_block_word_map_is_disjoint() -> None:
    words_in_block = IPC.words(NUM_SLOTS, 3)
    cb = ChannelBlock(np.zeros(words_in_block, dtype=np.int64), IPC, NUM_SLOTS, 3)
    words = {cb.slot(j, f) for j in range(NUM_SLOTS) for f in range(SLOT_WORDS)} | {
        cb.reader(i, f) for i in range(3) for f in range(READER_WORDS)
    }
    assert len(words) == NUM_SLOTS * SLOT_WORDS + 3 * READER_WORDS
    assert min(words) >= SLOT_BASE
    assert max(words) < words_in_block


def test_channel_header_describes_its_block_and_bad_headers_are_refused() -> None:
    """The sender writes a header a reader accepts (`ChannelBlock.of`); a reader count or a
    metadata offset that does not fit the segment is a MetadataError, not a wild mapping."""
    meta = b'{"backend":"host"}'
    segment, block = ChannelBlock.create(meta, 3, 4096, checksums=False)
    try:
        seen, raw = ChannelBlock.of(segment)
        assert (seen.num_readers, seen.num_slots, raw) == (3, NUM_SLOTS, meta)
        assert seen.writer_alive()
        for word, value in ((G_READERS, 0), (G_READERS, 10**6), (G_META_OFFSET, 8)):
            good = block.get(word)
            block.set(word, value)
            with pytest.raises(MetadataError, match="inconsistent header"):
                ChannelBlock.of(segment)
            block.set(word, good)
    finally:
        segment.close()
        segment.unlink()


@pytest.mark.parametrize("num_readers", [0, True, 2.0, 10**6])
def test_every_channel_refuses_a_bad_reader_count_alike(num_readers: Any) -> None:
    """IPC, ShmRing and SharedBuffer check a reader count the same way, before making anything."""
    layout = w.layout_of(w.make_state(0))
    makers = (
        lambda: CudaIpcSender(layout, num_readers, backend="host"),
        lambda: ShmRingSender(layout, num_readers),
        lambda: SharedBuffer(layout, num_readers),
    )
    for make in makers:
        with pytest.raises(ValueError, match=r"num_readers must be an int in \[1, \d+\]"):
            make()


@pytest.fixture(scope="module")
def ipc_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    path = str(tmp_path_factory.mktemp("ipc") / "name")
    results = w.run_ranks(w.scenario_ipc, 3, path, "host", timeout=120.0)
    return results


@pytest.mark.timeout(150)
def test_ipc_bit_exact_and_two_phase_aborts(ipc_run: dict[int, Any]) -> None:
    sender = ipc_run[0]
    for step in ("v1", "v2", "v3"):
        assert sender[step]["ok"], sender[step]
    for step in ("stale", "layout", "consumer"):
        assert sender[step]["type"] == "SyncAbortedError", sender[step]
    for rank in (1, 2):
        got = ipc_run[rank]
        assert got["v1"]["checksum"] == _expected(1)
        assert got["v2"]["checksum"] == _expected(2)
        assert got["stale"]["type"] == "VersionError"
        for step in ("stale", "layout", "consumer"):
            assert got[step]["applied"] == 2
            assert got[step]["checksum"] == _expected(2)
        assert got["v3"]["ok"], got["v3"]
        assert got["v3"]["checksum"] == _expected(3)
    assert ipc_run[2]["layout"]["type"] == "LayoutMismatchError"
    assert ipc_run[2]["layout"]["parameter"] == "layers.7.w"
    assert ipc_run[1]["layout"]["type"] == "SyncAbortedError"  # its version did not land either
    assert "injected consumer failure" in ipc_run[2]["consumer"]["message"]
    assert ipc_run[1]["consumer"]["type"] == "SyncAbortedError"


@pytest.mark.timeout(120)
def test_ipc_sender_killed(tmp_path: Path) -> None:
    results = w.run_ranks(w.scenario_ipc_kill, 3, str(tmp_path / "name"), 0, timeout=90.0, expect_dead=(0,))
    for rank in (1, 2):
        got = results[rank]
        assert got["type"] == "PeerLostError", got
        assert got["applied"] == 1
        assert got["checksum"] == _expected(1)


@pytest.mark.timeout(120)
def test_ipc_reader_killed(tmp_path: Path) -> None:
    results = w.run_ranks(w.scenario_ipc_kill, 3, str(tmp_path / "name"), 1, timeout=90.0, expect_dead=(1,))
    assert results[0]["type"] == "PeerLostError", results[0]
    assert "reader 0" in results[0]["message"]
    got = results[2]
    assert got["type"] == "SyncAbortedError", got
    assert got["applied"] == 1
    assert got["checksum"] == _expected(1)


@pytest.mark.gpu
@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_ipc_over_real_cuda_handles(tmp_path: Path) -> None:
    """On a GPU: the whole two-phase scenario above (versions, checksums, a stale version, a
    layout mismatch, a failing consumer) over real cudaMalloc slots shared by IPC handle,
    opened through CuPy and seen by torch through DLPack; every reader ends bit-exact."""
    pytest.importorskip("cupy")
    results = w.run_ranks(w.scenario_ipc, 3, str(tmp_path / "name"), "cuda", timeout=180.0)
    for rank in (1, 2):
        assert results[rank]["v3"]["checksum"] == _expected(3)


@pytest.mark.timeout(120)
def test_a_straggler_of_an_aborted_version_reads_its_own_bytes(tmp_path: Path) -> None:
    """Version 2 times out on the sender while the reader is still reading slot 0; version 3
    starts at once but rewrites no slot until that read is over."""
    results = w.run_ranks(scenario_ipc_straggler, 2, str(tmp_path / "name"), timeout=90.0)
    sender, reader = results[0], results[1]
    assert sender["v1"]["ok"], sender["v1"]
    assert sender["v2"]["type"] == "SyncTimeoutError", sender["v2"]
    assert sender["v3"]["ok"], sender["v3"]
    assert reader["v2"]["type"] == "SyncAbortedError", reader["v2"]
    assert reader["seen"] == reader["expected"], "the straggler read version 3's bytes in version 2's slot"
    assert reader["v3"]["ok"], reader["v3"]
    assert reader["applied"] == 3
    assert reader["checksum"] == _expected(3)


@pytest.mark.timeout(120)
def test_slots_a_live_reader_still_maps_are_kept_not_freed(tmp_path: Path) -> None:
    """(Freed once the reader left: test_ipc_commit.py.)"""
    results = w.run_ranks(scenario_ipc_kept_while_mapped, 2, str(tmp_path / "name"), timeout=90.0)
    sender, reader = results[0], results[1]
    assert sender["type"] == "SlotsStillMappedError", sender
    assert sender["readers"] == [0]
    assert "kept, not freed under a reader" in sender["message"]
    assert reader["next"]["type"] == "PeerLostError", reader["next"]
    assert reader["readable"] is True, "the reader's mapping still holds version 1"
    assert reader["applied"] == 1


@pytest.mark.gpu
@pytest.mark.timeout(200)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_failed_reader_settles_the_device_before_releasing_a_slot(tmp_path: Path) -> None:
    """On a GPU: the consumer queues a read of slot 0 on a side stream behind a one-second GPU
    spin and then fails; the receiver must synchronize the whole device before it acknowledges
    (else the sender's next version rewrites slot 0 under that read). The read sees version 1."""
    pytest.importorskip("cupy")
    results = w.run_ranks(scenario_ipc_settle, 2, str(tmp_path / "name"), timeout=180.0)
    sender, reader = results[0], results[1]
    assert sender["v1"]["type"] == "SyncAbortedError", sender["v1"]
    assert sender["v2"]["ok"], sender["v2"]
    assert reader["seen"] == reader["expected"]
    assert reader["v2"]["ok"], reader["v2"]
    assert reader["checksum"] == _expected(2)
