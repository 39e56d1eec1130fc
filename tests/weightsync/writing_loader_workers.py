"""Process bodies for `engines/test_writing_loader.py`: an engine loader that writes in place.

Some engines' ``load_weights`` write into the tensors they are handed (an in-place scale, a
permutation done on the input). A `LoadWeightsConsumer` in mode "stream" hands the engine views
of the bucket the transport landed, and a transport may land it in memory the receiver must not
write: a read-only shared-memory mapping (ShmRing, the node buffer's `copy_version`, CUDA IPC
host slots) or another process's memory. The engine must get memory it may write, in its own
process: these bodies run the reader in a spawned child, where a write into a read-only mapping
would kill it with SIGSEGV.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    CudaIpcReceiver,
    CudaIpcSender,
    LoadWeightsConsumer,
    SharedBuffer,
    SharedBufferReader,
    ShmRingReceiver,
    ShmRingSender,
    checksum,
)

DEADLINE = 60.0
VERSIONS = (1, 2)
TRANSPORTS = ("ring", "ipc_host", "copy_version")


class WritingEngine:
    """`load_weights` records what it was given, then writes every tensor in place (zeroes it)."""

    def __init__(self) -> None:
        self.seen: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.seen[name] = tensor.clone()
            tensor.zero_()  # in place, into the tensor it was handed


def _take(receive: Any, version: int) -> dict[str, Any]:
    engine = WritingEngine()
    consumer = LoadWeightsConsumer(w.layout_of(w.make_state(0)), engine.load_weights, mode="stream")
    consumer._version = version - 1  # the engine holds the previous version (applied elsewhere)
    got = w.outcome(lambda: receive(consumer))
    got["applied"] = consumer.version
    got["copied"] = consumer.copied_bytes
    got["seen"] = checksum(engine.seen) if len(engine.seen) == len(consumer.layout.tensors) else None
    return got


def scenario_writing_loader(rank: int, world: int, port: int, path: str, transport: str) -> dict[str, Any]:
    """Rank 0 sends versions 1 and 2 over `transport`; rank 1 takes each into a stream-mode
    consumer whose engine writes in place. Returns what rank 1's engine saw, per version."""
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        if transport == "ring":
            with ShmRingSender(layout, 1) as ring:
                w._publish_name(path, ring.name)
                for v in VERSIONS:
                    out[f"v{v}"] = w.outcome(lambda v=v: ring.send(w.make_state(v), v, DEADLINE))
        elif transport == "ipc_host":
            with CudaIpcSender(layout, 1, backend="host") as ipc:
                w._publish_name(path, ipc.name)
                for v in VERSIONS:
                    out[f"v{v}"] = w.outcome(lambda v=v: ipc.send(w.make_state(v), v, DEADLINE))
        else:
            with SharedBuffer(layout, 1, slots=3) as node:
                for v in VERSIONS:
                    node.publish(w.make_state(v), v, DEADLINE)
                w._publish_name(path, node.name)
                w._read_name(path + ".done")  # the reader copied every version out
                with SharedBufferReader.attach(node.name) as check:  # the node buffer is intact
                    check.refresh(DEADLINE)
                    out["node"] = checksum(check.tensors())
        return out
    name = w._read_name(path)
    if transport == "ring":
        with ShmRingReceiver.attach(name, 0) as ring_rx:
            for v in VERSIONS:
                out[f"v{v}"] = _take(lambda c: ring_rx.receive(c, DEADLINE), v)
    elif transport == "ipc_host":
        with CudaIpcReceiver.attach(name, 0) as ipc_rx:
            for v in VERSIONS:
                out[f"v{v}"] = _take(lambda c: ipc_rx.receive(c, DEADLINE), v)
    else:
        with SharedBufferReader.attach(name) as reader:
            for v in VERSIONS:
                out[f"v{v}"] = _take(lambda c, v=v: reader.copy_version(v, c, DEADLINE), v)
        w._publish_name(path + ".done", "done")
    return out
