"""Process bodies for `shm/test_node_buffer_deadlines.py` (spawned, under `run_ranks`).

Ranks 0 and 1 are two trainers ("a", "b"), each in its own member group with rank 2, the node's
receiver: it lands each version in its node buffer (a `SharedBuffer` whose `timeout_s` is far
longer than the syncs' deadlines), while a reader of that buffer stays bound to the older
version and does not refresh: the writer must wait for it under the *sync's* deadline and name
it when it gives up.
"""

from __future__ import annotations

from typing import Any

import weightsync_dist_workers as w
from member_workers import finish, member_store

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    MemberGroup,
    SharedBuffer,
    SharedBufferReader,
    SharesReceiver,
    checksum,
)

SYNC_DEADLINE = 2.0
BUFFER_TIMEOUT = 600.0  # the node buffer's own wait: the syncs' deadlines must win
DEADLINE = 60.0
SENDERS = ("a", "b")
RECEIVER = 2


def _group(store: Any, rank: int, sender: str) -> MemberGroup:
    members = [SENDERS.index(sender), RECEIVER]
    return MemberGroup.create(store, f"node-{sender}", members.index(rank), 2, DEADLINE)


def scenario_lingering_reader(rank: int, world: int, port: int) -> dict[str, Any]:
    """v3 from sender a alone (every bucket) and v4 from both (half each) fail at the sync's
    deadline naming the lingering reader; once it refreshes, v5 from both goes through."""
    store = member_store(rank)
    layout = w.layout_of(w.make_state(0), bucket=8 * 1024)
    half = len(layout.buckets) // 2
    shares = {"a": list(range(half)), "b": list(range(half, len(layout.buckets)))}
    out: dict[str, Any] = {}
    if rank in (0, 1):
        sender = SENDERS[rank]
        tx = BroadcastSender(layout, _group(store, rank, sender), 0)
        if sender == "a":
            out["alone"] = w.outcome(lambda: tx.send(w.make_state(3), 3, DEADLINE).version)
        for label, version in (("shares", 4), ("after", 5)):
            out[label] = w.outcome(
                lambda v=version: tx.send(w.make_state(v), v, DEADLINE, buckets=shares[sender]).version
            )
    else:
        rx = {s: BroadcastReceiver(layout, _group(store, rank, s), 0) for s in SENDERS}
        node = SharedBuffer(layout, 1, timeout_s=BUFFER_TIMEOUT)
        node.publish(w.make_state(1), 1, DEADLINE)
        reader = SharedBufferReader.attach(node.name)
        reader.refresh(DEADLINE)  # bound to version 1 ...
        node.publish(w.make_state(2), 2, DEADLINE)  # ... and stays there: the next version needs its slot
        out["alone"] = w.outcome(lambda: rx["a"].receive(node, SYNC_DEADLINE).version)
        parts = [(s, rx[s], shares[s]) for s in SENDERS]
        out["shares"] = w.outcome(lambda: SharesReceiver(parts).receive(node, SYNC_DEADLINE))
        out["node_version"] = node.latest_version()
        reader.refresh(DEADLINE)
        out["after"] = w.outcome(lambda: SharesReceiver(parts).receive(node, DEADLINE))
        reader.refresh(DEADLINE)
        out["checksum"] = checksum(reader.tensors())
        reader.close()
        node.close()
    finish(store, rank, [0, 1, RECEIVER])
    return out
