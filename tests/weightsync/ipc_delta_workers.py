"""Process bodies for the CUDA IPC delta tests: one writer (fp32 weights, bf16 wire,
``delta="auto"``, host slots) and two readers (a DoubleBuffer and a node buffer) on one node.

A version lands on every reader of an IPC channel or on none: a reader whose base is corrupted
refuses the delta by digest, which aborts the version for both (each keeps its own), and the
writer forgets its base, so the next version goes full.
"""

from __future__ import annotations

from typing import Any

import wire_workers as ww
from delta_readers import corrupt_newest, double_reader, signal, wait_signal, wire_reader
from testkit import outcome

from rlfleet.weightsync import (
    CudaIpcReceiver,
    CudaIpcSender,
    checksum,
)

DEADLINE = 30.0
VERSIONS = range(1, 9)
RESTART_BEFORE, CORRUPT_BEFORE = 4, 6


def _send_all(sender: CudaIpcSender, path: str) -> dict[str, Any]:
    """Versions 1-8; before 4 the writer waits until reader 0 has re-attached."""
    steps: dict[str, Any] = {}
    for version in VERSIONS:
        if version == RESTART_BEFORE:
            wait_signal(path + ".restarted", "restart signal")
        step = outcome(lambda v=version: sender.send(ww.trainer_state(v), v, DEADLINE))
        assert sender.delta is not None
        last = sender.delta.last
        step.update(
            base=last.base,
            sent=last.sent_bytes,
            full=last.full_bytes,
            lacking=list(sender.last_full_readers),
            offer_after=sender.delta.offer(),
        )
        steps[f"v{version}"] = step
    return steps


def _read_all(rank: int, name: str, path: str) -> dict[str, Any]:
    """Reader `rank - 1`: rank 1 (a DoubleBuffer) restarts before 4 (closes, re-attaches with a
    fresh consumer: version -1, no base); rank 2 (a node buffer) corrupts its base before 6."""
    steps: dict[str, Any] = {}
    receiver = CudaIpcReceiver.attach(name, rank - 1)
    consumer, reader, weights = wire_reader(rank)
    try:
        for version in VERSIONS:
            if rank == 1 and version == RESTART_BEFORE:
                receiver.close()
                consumer, weights = double_reader(ww.served(0), ww.engine_layout())
                receiver = CudaIpcReceiver.attach(name, rank - 1)
                signal(path + ".restarted", "1")
            if rank == 2 and version == CORRUPT_BEFORE:
                corrupt_newest(consumer)
            result = outcome(lambda r=receiver, c=consumer: r.receive(c, DEADLINE))
            result["applied"] = consumer.version
            result["exact"] = (
                checksum(weights()) == checksum(ww.served(consumer.version)) if consumer.version > 0 else None
            )
            steps[f"v{version}"] = result
    finally:
        receiver.close()
        if reader is not None:
            reader.close()
            consumer.close()  # the harness leaves by os._exit (no atexit)
    return steps


def scenario_ipc_delta(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """Rank 0 writes versions 1-8 through a CUDA IPC channel (host slots) to ranks 1 and 2."""
    if rank == 0:
        sender = CudaIpcSender(ww.wire_layout(), world - 1, backend="host", checksums=True, delta="auto")
        with sender:
            signal(path, sender.name)
            return _send_all(sender, path)
    return _read_all(rank, wait_signal(path, "channel name"), path)
