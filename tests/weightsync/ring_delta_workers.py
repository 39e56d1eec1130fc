"""Process bodies for the ShmRing delta tests: one writer (fp32 weights, bf16 wire,
``delta="auto"``) and two readers (a DoubleBuffer and a node buffer) on one node.

Readers commit one by one on a ring: a reader whose base is corrupted refuses the delta by
digest and keeps its version while the other commits; it then holds another base than the
writer's, so the next version goes full.
"""

from __future__ import annotations

from typing import Any

import wire_workers as ww
from delta_readers import corrupt_newest, double_reader, signal, wait_signal, wire_reader
from testkit import outcome

from rlfleet.weightsync import (
    ShmRingReceiver,
    ShmRingSender,
    checksum,
)

DEADLINE = 30.0
VERSIONS = range(1, 9)


def scenario_ring_delta(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """Versions 1-8 over a ring of two slots. Reader 0 (rank 1, a DoubleBuffer) restarts before 4
    (a fresh consumer: 4 goes full to both); reader 1 (rank 2, a node buffer) corrupts its base
    before 6 (it refuses 6, reader 0 commits it); 7 goes full, 8 is a delta again."""
    steps: dict[str, Any] = {}
    if rank == 0:
        sender = ShmRingSender(ww.wire_layout(), world - 1, slots=2, checksums=True, delta="auto")
        with sender:
            signal(path, sender.name)
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
    receiver = ShmRingReceiver.attach(wait_signal(path, "ring name"), rank - 1)
    consumer, reader, weights = wire_reader(rank)
    with receiver:
        for version in VERSIONS:
            if rank == 1 and version == 4:
                consumer, weights = double_reader(
                    ww.served(0), ww.engine_layout()
                )  # a restart: version -1, no base
            if rank == 2 and version == 6:
                corrupt_newest(consumer)
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
