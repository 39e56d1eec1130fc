"""Deltas through CUDA IPC slots (host backend) across real processes: bit-exact in bf16, a
restarted reader makes the version full, a corrupted base is refused by digest (the version is
aborted on every reader, each keeps its own) and the next version is full and bit-exact."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ipc_delta_workers as idw
import pytest
from weightsync_dist_workers import run_ranks

from rlfleet.weightsync import CudaIpcSender

READERS = (1, 2)


@pytest.fixture(scope="module")
def ipc_run(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    path = Path(tmp_path_factory.mktemp("ipc_delta")) / "name"
    return run_ranks(idw.scenario_ipc_delta, 3, str(path), timeout=200.0)


def _sent(ipc_run: dict[int, Any], version: int) -> dict[str, Any]:
    step: dict[str, Any] = ipc_run[0][f"v{version}"]
    assert step["ok"], step
    return step


def _applied_exactly(ipc_run: dict[int, Any], versions: tuple[int, ...]) -> None:
    for rank in READERS:
        for v in versions:
            step = ipc_run[rank][f"v{v}"]
            assert step["ok"], (rank, v, step)
            assert step["applied"] == v
            assert step["exact"], (rank, v, step)


@pytest.mark.timeout(260)
def test_ipc_deltas_are_bit_exact_in_bf16(ipc_run: dict[int, Any]) -> None:
    first = _sent(ipc_run, 1)
    assert first["base"] is None
    assert first["value"] == first["full"]
    for v in (2, 3, 5, 8):
        sent = _sent(ipc_run, v)
        assert sent["base"] == v - 1, (v, sent)
        assert sent["lacking"] == []
        assert sent["value"] == sent["sent"]  # send returns the bytes that moved
        assert sent["sent"] < 0.5 * sent["full"], (v, sent)
    _applied_exactly(ipc_run, (1, 2, 3, 5, 8))


@pytest.mark.timeout(260)
def test_a_restarted_ipc_reader_makes_the_version_full(ipc_run: dict[int, Any]) -> None:
    v4 = _sent(ipc_run, 4)
    assert v4["base"] is None
    assert v4["lacking"] == [0]
    assert v4["sent"] == v4["full"] == v4["value"]
    _applied_exactly(ipc_run, (4,))


@pytest.mark.timeout(260)
def test_a_corrupted_ipc_base_is_refused_by_digest_and_the_next_version_is_full(
    ipc_run: dict[int, Any],
) -> None:
    v6 = ipc_run[0]["v6"]
    assert not v6["ok"], v6
    assert v6["type"] == "SyncAbortedError", v6
    assert "reader(s) [1]" in v6["message"]
    assert v6["base"] == 5
    assert v6["offer_after"] is None  # the torn base is forgotten
    refused = ipc_run[2]["v6"]
    assert refused["type"] == "ChecksumMismatchError", refused
    assert "digest" in refused["message"]
    assert refused["applied"] == 5  # keeps serving 5
    assert ipc_run[1]["v6"]["type"] == "SyncAbortedError"
    assert ipc_run[1]["v6"]["applied"] == 5  # a version lands on all readers or on none
    v7 = _sent(ipc_run, 7)
    assert v7["base"] is None
    assert v7["lacking"] == []  # nothing was offered
    assert v7["sent"] == v7["full"]
    _applied_exactly(ipc_run, (7,))


def test_ipc_delta_is_off_by_default_and_a_bad_mode_is_named() -> None:
    import wire_workers as ww

    with pytest.raises(ValueError, match="delta must be one of"):
        CudaIpcSender(ww.wire_layout(), 1, backend="host", delta="on")
    assert CudaIpcSender.__init__.__kwdefaults__["delta"] == "off"
    with CudaIpcSender(ww.wire_layout(), 1, backend="host", detach_timeout_s=0.0) as sender:
        assert sender.delta is None


def test_the_channel_writer_passes_its_delta_mode_to_the_sender() -> None:
    """What policygroup's ``weight_buffer.delta`` reaches: a channel per delta mode."""
    import wire_workers as ww

    from rlfleet.weightsync import IpcChannelWriter

    writer = IpcChannelWriter(detach_timeout_s=0.0)
    try:
        plain = writer.channel(["r0"], ww.wire_layout(), "host")
        assert writer._sender is not None  # the test looks at the writer's sender
        assert writer._sender.delta is None
        deltas = writer.channel(["r0"], ww.wire_layout(), "host", delta="auto")
        assert deltas != plain  # another mode: another channel
        assert writer._sender.delta is not None
        assert writer._sender.delta.mode == "auto"
    finally:
        writer.close()
