"""Process bodies for the CUDA IPC session and lifetime tests (spawned, under `run_ranks`).

Rank 0 is the sender, rank 1 the one reader. ``backend="host"`` runs the control plane over
shared memory (any machine); the settle scenario needs CUDA slots.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    CudaIpcReceiver,
    CudaIpcSender,
    Layout,
    RecordingConsumer,
    SlotsStillMappedError,
    bucket_views,
    checksum,
    pack_bucket,
)


def _bucket_sum(layout: Layout, k: int, data: torch.Tensor) -> str:
    """Checksum of the tensors of bucket `k` in `data` (padding between them ignored)."""
    return checksum({name: view.cpu() for name, view in bucket_views(layout, k, data).items()})


def _packed(layout: Layout, k: int, state: Mapping[str, torch.Tensor], device: str) -> torch.Tensor:
    buffer = torch.zeros(layout.buckets[k].nbytes, dtype=torch.uint8, device=device)
    return pack_bucket(layout, k, state, buffer)


class _SlowFirstBucket(RecordingConsumer):
    """Version 2 only: bucket 0 is read `delay` seconds after it is handed over (a straggler)."""

    def __init__(self, layout: Layout, initial: Mapping[str, torch.Tensor], delay: float) -> None:
        super().__init__(layout, initial)
        self.delay = delay
        self.seen: str | None = None

    def consume(self, index: int, data: torch.Tensor) -> None:
        if self._pending == 2 and index == 0:
            time.sleep(self.delay)  # a slow consumer (simulated work) while the bucket is held
            self.seen = _bucket_sum(self._layout, 0, data)
        super().consume(index, data)


def scenario_ipc_straggler(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """The sender gives up on version 2 (deadline) while the reader still reads its slot 0;
    version 3 follows at once. The straggler must read version 2's bytes, not version 3's."""
    layout = w.layout_of(w.make_state(0))
    if rank == 0:
        with CudaIpcSender(layout, 1, backend="host") as sender:
            w._publish_name(path, sender.name)
            out = {"v1": w.outcome(lambda: sender.send(w.make_state(1), 1, w.DEADLINE))}
            out["v2"] = w.outcome(lambda: sender.send(w.make_state(2), 2, 1.5))
            out["v3"] = w.outcome(lambda: sender.send(w.make_state(3), 3, w.DEADLINE))
            return out
    with CudaIpcReceiver.attach(w._read_name(path), 0) as receiver:
        consumer = _SlowFirstBucket(layout, w.make_state(0), delay=4.0)
        out = {step: w.outcome(lambda: receiver.receive(consumer, w.DEADLINE)) for step in ("v1", "v2", "v3")}
        out["seen"] = consumer.seen
        out["expected"] = _bucket_sum(layout, 0, _packed(layout, 0, w.make_state(2), "cpu"))
        out["applied"] = consumer.version
        out["checksum"] = checksum(consumer.weights)
        return out


def scenario_ipc_kept_while_mapped(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """The sender closes while the reader still maps the slots: it waits `detach_timeout_s`,
    then keeps the slots (freed once the reader left) and names the reader; the reader's
    mapping stays readable."""
    layout = w.layout_of(w.make_state(0))
    closed = path + ".closed"
    if rank == 0:
        sender = CudaIpcSender(layout, 1, backend="host", detach_timeout_s=1.0)
        w._publish_name(path, sender.name)
        sender.send(w.make_state(1), 1, w.DEADLINE)
        result: dict[str, Any] = {"ok": True}
        try:
            sender.close()
        except SlotsStillMappedError as exc:
            result = {"ok": False, "type": type(exc).__name__, "message": str(exc), "readers": exc.readers}
        w._publish_name(closed, "closed")
        return result
    receiver = CudaIpcReceiver.attach(w._read_name(path), 0)
    consumer = RecordingConsumer(layout, w.make_state(0))
    receiver.receive(consumer, w.DEADLINE)
    w._read_name(closed)
    out = {"next": w.outcome(lambda: receiver.receive(consumer, 5.0))}
    slot = receiver._slots.tensors[0]  # still mapped: the sender did not free it
    last = max(range(0, len(layout.buckets), 2))  # the last bucket of version 1 that went through slot 0
    out["readable"] = _bucket_sum(layout, last, slot) == _bucket_sum(
        layout, last, _packed(layout, last, w.make_state(1), "cpu")
    )
    receiver.close()
    out["applied"] = consumer.version
    return out


class _FailsAfterSideRead(RecordingConsumer):
    """Version 1, bucket 0: queue a read of the slot on a side stream behind a GPU spin, then
    fail. The receiver must wait for that read (device sync) before it releases the slot."""

    def __init__(self, layout: Layout, initial: Mapping[str, torch.Tensor]) -> None:
        super().__init__(layout, initial)
        self.copy: torch.Tensor | None = None

    def consume(self, index: int, data: torch.Tensor) -> None:
        if self._pending == 1 and index == 0:
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(2_000_000_000)  # about a second of GPU spin before the read
                self.copy = data.clone()
            raise RuntimeError("injected failure after queueing a side-stream read")
        super().consume(index, data)


def scenario_ipc_settle(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """CUDA slots: the reader fails version 1 with a read still queued on a side stream; the
    sender sends version 2 at once. The queued read must see version 1's bytes."""
    torch.cuda.set_device(0)
    base = {k: v.cuda() for k, v in w.make_state(0).items()}
    layout = w.layout_of(base)
    if rank == 0:
        with CudaIpcSender(layout, 1, backend="cuda") as sender:
            w._publish_name(path, sender.name)
            state = {v: {k: t.cuda() for k, t in w.make_state(v).items()} for v in (1, 2)}
            out = {"v1": w.outcome(lambda: sender.send(state[1], 1, w.DEADLINE))}
            out["v2"] = w.outcome(lambda: sender.send(state[2], 2, w.DEADLINE))
            return out
    with CudaIpcReceiver.attach(w._read_name(path), 0) as receiver:
        consumer = _FailsAfterSideRead(layout, base)
        out = {"v1": w.outcome(lambda: receiver.receive(consumer, w.DEADLINE))}
        out["v2"] = w.outcome(lambda: receiver.receive(consumer, w.DEADLINE))
        torch.cuda.synchronize()
        assert consumer.copy is not None
        out["seen"] = _bucket_sum(layout, 0, consumer.copy)
        one = {k: t.cuda() for k, t in w.make_state(1).items()}
        out["expected"] = _bucket_sum(layout, 0, _packed(layout, 0, one, "cuda"))
        out["checksum"] = checksum({k: t.cpu() for k, t in consumer.weights.items()})
        return out
