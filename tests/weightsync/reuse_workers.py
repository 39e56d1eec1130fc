"""Process bodies for `test_stream_reuse.py`: a producer that reuses one buffer for every tensor.

A trainer that gathers each parameter into the same scratch buffer (a common way to gather)
yields views of that buffer: the tensor it yielded is overwritten as soon as the next one is
asked for. Every sender must therefore consume (or copy) a stream's tensor before it pulls the
next one.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    CudaIpcReceiver,
    CudaIpcSender,
    Layout,
    RecordingConsumer,
    checksum,
)

DEADLINE = 30.0
BUCKET = 64 * 1024
VERSIONS = (1, 2)


def reusing(layout: Layout, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """`state` in `layout`'s order, every tensor yielded as a view of one reused buffer."""
    largest = max((spec.nbytes for spec in layout.tensors), default=0)
    scratch = torch.empty(max(largest, 1), dtype=torch.uint8)
    for spec in layout.tensors:
        view = scratch[: spec.nbytes].view(spec.torch_dtype).view(spec.shape)
        view.copy_(state[spec.name])
        yield spec.name, view  # overwritten by the next tensor


def layout() -> Layout:
    return w.layout_of(w.make_state(0), BUCKET)


def _received(consumer: RecordingConsumer, fn: Any) -> dict[str, Any]:
    result = w.outcome(fn)
    result["applied"] = consumer.version
    result["checksum"] = checksum(consumer.weights)
    return result


def scenario_reuse_broadcast(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 0 broadcasts a reusing stream (with and without checksums); ranks 1, 2 receive it
    into their own buffers (rank 1) or straight into their tensors (rank 2)."""
    w.init(rank, world, port)
    lay = layout()
    out: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(lay, None, 0, direct_min=w.DIRECT_MIN)
        for version in VERSIONS:
            sender.checksums = version % 2 == 0
            stream = reusing(lay, w.make_state(version))
            out[f"v{version}"] = w.outcome(lambda s=stream, v=version: sender.send(s, v, DEADLINE).version)
        return out
    receiver = BroadcastReceiver(lay, None, 0)
    consumer = RecordingConsumer(lay, w.make_state(0), bucket_targets=rank == 1, tensor_targets=rank == 2)
    for version in VERSIONS:
        out[f"v{version}"] = _received(consumer, lambda: receiver.receive(consumer, DEADLINE).version)
    return out


def scenario_reuse_ipc(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """CUDA IPC in host mode: rank 0 sends a reusing stream, ranks 1, 2 read the channel."""
    lay = layout()
    out: dict[str, Any] = {}
    if rank == 0:
        with CudaIpcSender(lay, world - 1, backend="host", checksums=True) as sender:
            w._publish_name(path, sender.name)
            for version in VERSIONS:
                stream = reusing(lay, w.make_state(version))
                out[f"v{version}"] = w.outcome(lambda s=stream, v=version: sender.send(s, v, DEADLINE))
        return out
    with CudaIpcReceiver.attach(w._read_name(path), rank - 1) as receiver:
        consumer = RecordingConsumer(lay, w.make_state(0))
        for version in VERSIONS:
            out[f"v{version}"] = _received(consumer, lambda: receiver.receive(consumer, DEADLINE))
    return out
