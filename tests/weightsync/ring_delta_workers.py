"""Process bodies for the ShmRing delta tests: one writer (fp32 weights, bf16 wire,
``delta="auto"``) and two readers (a DoubleBuffer and a node buffer) on one node.

Readers commit one by one on a ring: a reader whose base is corrupted refuses the delta by
digest and keeps its version while the other commits; it then holds another base than the
writer's, so the next version goes full.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import wire_workers as ww
from testkit import outcome

from rlfleet.weightsync import (
    DoubleBuffer,
    SharedBuffer,
    SharedBufferReader,
    ShmRingReceiver,
    ShmRingSender,
    checksum,
)

DEADLINE = 30.0
VERSIONS = range(1, 9)


def _publish(path: str, name: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(name)
    os.replace(tmp, path)


def _wait_name(path: str) -> str:
    end = time.monotonic() + 60.0
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no ring name at {path}")
        time.sleep(0.01)
    with open(path) as fh:
        return fh.read()


def _double() -> tuple[DoubleBuffer, Any]:
    live = {k: torch.zeros_like(v) for k, v in ww.served(0).items()}
    return DoubleBuffer(live, ww.engine_layout()), lambda: {k: v.clone() for k, v in live.items()}


def _node() -> tuple[SharedBuffer, SharedBufferReader, Any]:
    shared = SharedBuffer(ww.engine_layout(), num_readers=1)
    reader = SharedBufferReader.attach(shared.name)

    def weights() -> dict[str, torch.Tensor]:
        if shared.version < 0:
            return {}
        reader.wait_for_version(shared.version, 10.0)
        return {k: v.clone() for k, v in reader.tensors().items()}

    return shared, reader, weights


def _corrupt(shared: SharedBuffer) -> None:
    """Flip a byte of the node buffer's newest slot (the base of the next delta)."""
    newest = shared._table.newest()  # the test reaches into the node buffer to corrupt its slot
    assert newest is not None
    shared._slots[newest][100] ^= 0xFF


def scenario_ring_delta(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """Versions 1-8 over a ring of two slots. Reader 0 (rank 1, a DoubleBuffer) restarts before 4
    (a fresh consumer: 4 goes full to both); reader 1 (rank 2, a node buffer) corrupts its base
    before 6 (it refuses 6, reader 0 commits it); 7 goes full, 8 is a delta again."""
    steps: dict[str, Any] = {}
    if rank == 0:
        sender = ShmRingSender(ww.wire_layout(), world - 1, slots=2, checksums=True, delta="auto")
        with sender:
            _publish(path, sender.name)
            for version in VERSIONS:

                def one(v: int = version) -> dict[str, Any]:
                    outcomes = sender.send(ww.trainer_state(v), v, DEADLINE)
                    assert sender.delta is not None
                    last = sender.delta.last
                    return {
                        "outcomes": {str(k): o for k, o in outcomes.items()},
                        "base": last.base,
                        "sent": last.sent_bytes,
                        "full": last.full_bytes,
                        "lacking": list(sender.last_full_readers),
                    }

                steps[f"v{version}"] = outcome(one)
        return steps
    receiver = ShmRingReceiver.attach(_wait_name(path), rank - 1)
    reader: SharedBufferReader | None = None
    consumer: Any
    if rank == 1:
        consumer, weights = _double()
    else:
        consumer, reader, weights = _node()
    with receiver:
        for version in VERSIONS:
            if rank == 1 and version == 4:
                consumer, weights = _double()  # a restart: version -1, no base
            if rank == 2 and version == 6:
                _corrupt(consumer)
            result = outcome(lambda c=consumer: receiver.receive(c, DEADLINE))
            result["applied"] = consumer.version
            result["exact"] = (
                checksum(weights()) == checksum(ww.served(consumer.version)) if consumer.version > 0 else None
            )
            steps[f"v{version}"] = result
    if reader is not None:
        reader.close()
        consumer.close()  # the harness leaves by os._exit (no atexit)
    return steps
