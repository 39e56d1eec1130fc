"""Process bodies for `test_streaming.py`: senders fed by a stream of (name, tensor) pairs.

Run under `weightsync_dist_workers.run_ranks` (spawned processes). A broadcast over the default
gloo group streams good versions and every kind of broken stream; an FSDP2 trainer on two gloo
ranks streams one gathered parameter at a time over a broadcast (to another process) and over a
ShmRing (to a reader process on the node), and a broken stream there must not leave the
trainer's other rank stuck in a gather.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import fsdp2_workers as f
import member_workers as m
import torch
import torch.distributed as dist
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    DoubleBuffer,
    Layout,
    MemberGroup,
    RecordingConsumer,
    ShmRingReceiver,
    ShmRingSender,
    WeightStream,
    checksum,
    full_tensors,
    layout_entries,
)

DEADLINE = 30.0
BUCKET = 16 * 1024


class Counted:
    """An iterable of pairs that counts what its consumer took (to see a stream drained)."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.pairs = pairs
        self.taken = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pair in self.pairs:
            self.taken += 1
            yield pair


def broken_streams(version: int) -> dict[str, list[tuple[str, Any]]]:
    """Streams of `version` that break the layout in one way each (see `BROKEN`)."""
    good = list(w.make_state(version).items())
    names = [n for n, _ in good]
    at = names.index("layers.60.w")
    swapped = list(good)
    swapped[at], swapped[at + 1] = swapped[at + 1], swapped[at]
    wrong_shape = list(good)
    wrong_shape[at] = (names[at], torch.zeros(good[at][1].numel() + 1, dtype=good[at][1].dtype))
    wrong_dtype = list(good)
    wrong_dtype[at] = (names[at], good[at][1].to(torch.float64))
    return {
        "order": swapped,
        "missing": [*good[:at], *good[at + 1 :]],
        "missing_last": good[:-1],
        "extra_end": [*good, ("not.in.layout", torch.zeros(3))],
        "unexpected": [*good[:at], ("not.in.layout", torch.zeros(3)), *good[at:]],
        "twice": [*good, good[0]],
        "shape": wrong_shape,
        "dtype": wrong_dtype,
        "not_a_tensor": [*good[:at], (names[at], [1.0, 2.0]), *good[at + 1 :]],
    }


#: What each broken stream must be blamed on: (error type, the parameter it names).
BROKEN = {
    "order": ("LayoutMismatchError", "layers.61.w"),
    "missing": ("LayoutMismatchError", "layers.61.w"),
    "missing_last": ("LayoutMismatchError", "transposed"),
    "extra_end": ("LayoutMismatchError", "not.in.layout"),
    "unexpected": ("LayoutMismatchError", "not.in.layout"),
    "twice": ("LayoutMismatchError", "embed.weight"),
    "shape": ("LayoutMismatchError", "layers.60.w"),
    "dtype": ("LayoutMismatchError", "layers.60.w"),
    "not_a_tensor": ("LayoutMismatchError", "layers.60.w"),
    "raises": ("SyncAbortedError", None),
}


def _raising(version: int) -> Iterator[tuple[str, torch.Tensor]]:
    for i, pair in enumerate(w.make_state(version).items()):
        if i == 70:
            raise RuntimeError("injected failure producing a tensor")
        yield pair


def scenario_stream_broadcast(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 0 streams versions over the default group; ranks 1 and 2 receive (in place, landed)."""
    w.init(rank, world, port)
    layout = w.layout_of(w.make_state(0), BUCKET)
    steps: dict[str, Any] = {"buckets": len(layout.buckets)}
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, direct_min=w.DIRECT_MIN)

        def send(weights: Any, version: int) -> dict[str, Any]:
            return w.outcome(lambda: sender.send(weights, version, DEADLINE).wire_bytes)

        steps["v1"] = send(iter(w.make_state(1).items()), 1)  # a bare iterator is a stream
        sender.checksums = True
        steps["v2"] = send(WeightStream(w.make_state(2).items()), 2)
        for case, pairs in broken_streams(3).items():
            counted = Counted(pairs)
            steps[case] = send(counted, 3)
            steps[case]["drained"] = counted.taken == len(pairs)
        steps["raises"] = send(_raising(3), 3)
        used = WeightStream(w.make_state(3).items())
        list(used)
        steps["reused"] = send(used, 3)  # refused before anything is sent
        steps["v3"] = send(WeightStream(w.make_state(3).items()), 3)
        steps["mapping"] = send(w.make_state(4), 4)  # the state-dict path is unchanged
        steps["broken"] = sender.broken
        return steps
    receiver = BroadcastReceiver(layout, None, 0)
    consumer = RecordingConsumer(layout, w.make_state(0), bucket_targets=rank == 1, tensor_targets=rank == 2)

    def recv() -> dict[str, Any]:
        result = w.outcome(lambda: receiver.receive(consumer, DEADLINE).version)
        result["applied"] = consumer.version
        result["checksum"] = checksum(consumer.weights)
        return result

    for step in ("v1", "v2", *broken_streams(3), "raises", "v3", "mapping"):
        steps[step] = recv()
    steps["broken"] = receiver.broken
    return steps


def scenario_stream_ipc(rank: int, world: int, port: int, path: str, backend: str) -> dict[str, Any]:
    """CUDA IPC (`backend` "host": the same state machine over shared memory): rank 0 streams."""
    from rlfleet.weightsync import CudaIpcReceiver, CudaIpcSender

    device = "cuda" if backend == "cuda" else "cpu"
    layout = w.layout_of(w.make_state(0), BUCKET)
    steps: dict[str, Any] = {}
    if rank == 0:
        with CudaIpcSender(layout, world - 1, backend=backend, checksums=True) as sender:  # type: ignore[arg-type]
            w._publish_name(path, sender.name)
            for step, version in IPC_STEPS:
                pairs = [(n, t.to(device)) for n, t in _pairs(step, version)]
                counted = Counted(pairs)
                steps[step] = w.outcome(lambda: sender.send(counted, version, DEADLINE))  # noqa: B023
                steps[step]["drained"] = counted.taken == len(pairs)
        return steps
    with CudaIpcReceiver.attach(w._read_name(path), rank - 1) as receiver:
        consumer = RecordingConsumer(layout, w.make_state(0))
        for step, _ in IPC_STEPS:
            result = w.outcome(lambda: receiver.receive(consumer, DEADLINE))
            result["applied"] = consumer.version
            result["checksum"] = checksum(consumer.weights)
            steps[step] = result
    return steps


#: (step, version) of the IPC scenario: good versions around broken streams.
IPC_STEPS = [("v1", 1), ("order", 2), ("missing_last", 2), ("extra_end", 2), ("v2", 3)]


def _pairs(step: str, version: int) -> list[tuple[str, Any]]:
    return list(w.make_state(version).items()) if step.startswith("v") else broken_streams(version)[step]


def ring_reader(name: str, index: int, bucket: int, steps: int, queue: Any) -> None:
    """A reader process: `steps` receives into a DoubleBuffer, each reported (version, checksum)."""
    layout = w.layout_of(w.make_state(0), bucket)
    live = {k: torch.zeros_like(v) for k, v in w.make_state(0).items()}
    buffer = DoubleBuffer(live, layout)
    receiver = ShmRingReceiver.attach(name, index)
    try:
        for _ in range(steps):
            result = w.outcome(lambda: receiver.receive(buffer, DEADLINE))
            queue.put((index, result["ok"], result.get("type"), buffer.version, checksum(live)))
    finally:
        receiver.close()


# -- an FSDP2 trainer ---------------------------------------------------------------------------
def _renamed(
    pairs: Iterator[tuple[str, torch.Tensor]], old: str, new: str
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in pairs:
        yield (new if name == old else name), tensor


def _send(sender: Any, stream: Iterator[tuple[str, torch.Tensor]], version: int) -> dict[str, Any]:
    return w.outcome(lambda: sender.send(stream, version, DEADLINE))


def _trainer(store: Any, rank: int, layout: Layout, versions: int, broken_at: int) -> dict[str, Any]:
    """Ranks 0 and 1: FSDP2 on gloo; rank 0 streams each version over a broadcast and a ring."""
    f.trainer_group(store, rank)
    model = f.build()
    f.shard(model)
    out: dict[str, Any] = {"sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}
    sender = ring = None
    if rank == 0:
        sender = BroadcastSender(layout, MemberGroup.create(store, "xnode", 0, 2, DEADLINE), 0)
        ring = ShmRingSender(layout, 1)
        store.set("ring", ring.name)
    for version in range(1, versions + 1):
        if version > 1:
            f.train_step(model, version)
        for transport in ("broadcast", "ring"):
            stream = full_tensors(model)
            if version == broken_at:  # a stream that names a parameter wrongly, half-way
                stream = _renamed(stream, "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.up")
            if sender is None or ring is None:
                for _ in stream:  # every rank takes part in every gather
                    pass
                continue
            target: Any = sender if transport == "broadcast" else ring
            out[f"{transport}/v{version}"] = _send(target, stream, version)
        dist.barrier()  # both ranks are in step after a broken version too
    m.finish(store, rank, range(4))
    if ring is not None:
        ring.close()
    dist.destroy_process_group()
    return out


def scenario_fsdp2_stream(rank: int, world: int, port: int, versions: int, broken_at: int) -> dict[str, Any]:
    """0, 1: the FSDP2 trainer; 2: a receiver across the broadcast; 3: a ShmRing reader."""
    store = m.member_store(rank)
    layout = Layout(layout_entries(f.build()), 8 * 1024)  # from the unsharded module: same entries
    if rank in (0, 1):
        return _trainer(store, rank, layout, versions, broken_at)
    live = {k: torch.zeros_like(v) for k, v in f.reference(1).items()}
    buffer = DoubleBuffer(live, layout)
    out: dict[str, Any] = {}
    if rank == 2:
        receiver: Any = BroadcastReceiver(layout, MemberGroup.create(store, "xnode", 1, 2, DEADLINE), 0)
    else:
        store.wait(["ring"], timedelta(seconds=DEADLINE))
        receiver = ShmRingReceiver.attach(store.get("ring").decode(), 0)
    for version in range(1, versions + 1):
        result = w.outcome(lambda: receiver.receive(buffer, DEADLINE))
        result["applied"] = buffer.version
        result["bit_exact"] = checksum(live) == checksum(f.reference(buffer.version))
        out[f"v{version}"] = result
    if rank == 3:
        receiver.close()
    m.finish(store, rank, range(4))
    return out
