"""Process bodies for `protocol/test_background_sends.py`: non-blocking broadcasts over real gloo.

Rank 0 is a trainer: it sends with ``wait=False``, passes the fence (``snapshot_done``), then
changes its weights in place before the bytes have left; ranks 1 and 2 receive every version
into their own buffers and report what they applied.
"""

from __future__ import annotations

from typing import Any

import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import BroadcastReceiver, BroadcastSender, Layout, RecordingConsumer, checksum

DEADLINE = 30.0
VERSIONS = (1, 2, 3)


def _overwrite(state: dict[str, torch.Tensor], version: int) -> None:
    """Change every tensor in place to `version`'s values (what an optimizer step does)."""
    fresh = w.make_state(version)
    with torch.no_grad():
        for name, tensor in state.items():
            tensor.copy_(fresh[name])


def scenario_background_broadcast(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 0 sends v1..v3 with wait=False and scribbles over its weights after each fence, then
    one synchronous v4; receivers report the checksum of each version they applied."""
    w.init(rank, world, port)
    lay = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(lay, None, 0, direct_min=w.DIRECT_MIN)
        state = {k: v.clone() for k, v in w.make_state(0).items()}
        for version in VERSIONS:
            _overwrite(state, version)
            handle = sender.send(state, version, DEADLINE, wait=False)
            handle.snapshot_done()
            _overwrite(state, 100 + version)  # the next step's update, while the bytes move
            stats = handle.result()
            out[f"v{version}"] = {"sent": stats.version, "skipped": handle.skipped}
        _overwrite(state, 4)
        out["v4"] = {"sent": sender.send(state, 4, DEADLINE).version, "skipped": False}
        return out
    receiver = BroadcastReceiver(lay, None, 0)
    consumer = RecordingConsumer(lay, w.make_state(0), bucket_targets=rank == 1)
    for version in (*VERSIONS, 4):
        got = w.outcome(lambda: receiver.receive(consumer, DEADLINE).version)
        out[f"v{version}"] = {**got, "applied": consumer.version, "checksum": checksum(consumer.weights)}
    return out


def scenario_background_failure(rank: int, world: int, port: int) -> dict[str, Any]:
    """Receivers hold another model: the background send of v1 fails there; rank 0 learns it at
    its next call (v2), never silently, and the group stays usable for a good v3."""
    w.init(rank, world, port)
    mine = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(mine, None, 0, direct_min=w.DIRECT_MIN)
        state = w.make_state(1)
        first = sender.send(state, 1, DEADLINE, wait=False)
        first.snapshot_done()
        out["v1 finished"] = first.wait()  # the outcome is there, not collected by anyone
        out["v2"] = w.outcome(lambda: sender.send(w.make_state(2), 2, DEADLINE).version)
        out["v3"] = w.outcome(lambda: sender.send(w.make_state(3), 3, DEADLINE).version)
        return out
    other = {k: v for k, v in w.make_state(0).items() if k != "scalar"}
    lay = Layout.from_state_dict(other, mine.bucket_bytes)
    receiver = BroadcastReceiver(lay, None, 0)
    consumer = RecordingConsumer(lay, other)
    out["v1"] = w.outcome(lambda: receiver.receive(consumer, DEADLINE).version)
    good = RecordingConsumer(mine, w.make_state(0))
    out["v3"] = w.outcome(lambda: BroadcastReceiver(mine, None, 0).receive(good, DEADLINE).version)
    out["applied"] = good.version
    return out
