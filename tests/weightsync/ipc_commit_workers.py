"""Process bodies for the CUDA IPC channel's two-phase commit and slot lifetime tests (spawned,
under `weightsync_dist_workers.run_ranks`), over host slots (``backend="host"``: the same state
machine as on a GPU, over shared memory)."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import weightsync_dist_workers as w

from rlfleet.weightsync import (
    CudaIpcReceiver,
    CudaIpcSender,
    Deadline,
    DoubleBuffer,
    IpcChannelWriter,
    RecordingConsumer,
    checksum,
)

COMMIT_TIMEOUT = 1.0


def scenario_ipc_commit_fails(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """Versions 1-3 to two readers, each a DoubleBuffer; during version 2 a request on reader 2
    outlives its commit timeout, so reader 2 cannot commit: no reader may apply version 2, and
    the sender must not report it."""
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        with CudaIpcSender(layout, world - 1, backend="host") as sender:
            w._publish_name(path, sender.name)
            for version in (1, 2, 3):
                out[f"v{version}"] = w.outcome(lambda v=version: sender.send(w.make_state(v), v, w.DEADLINE))
        return out
    buffer = DoubleBuffer(
        {k: v.clone() for k, v in w.make_state(0).items()}, layout, commit_timeout_s=COMMIT_TIMEOUT
    )
    with CudaIpcReceiver.attach(w._read_name(path), rank - 1) as receiver:
        for version in (1, 2, 3):
            release, serving = threading.Event(), threading.Event()

            def stuck_request(release: threading.Event = release, serving: threading.Event = serving) -> None:
                with buffer.serving(w.DEADLINE):
                    serving.set()
                    release.wait(w.DEADLINE)

            request = threading.Thread(target=stuck_request)
            if version == 2 and rank == 2:
                request.start()
                serving.wait(w.DEADLINE)
            got = w.outcome(lambda: receiver.receive(buffer, w.DEADLINE))
            release.set()
            if request.is_alive():
                request.join(w.DEADLINE)
            got["applied"], got["checksum"] = buffer.version, checksum(buffer.live)
            got["pending"] = buffer.pending_version
            out[f"v{version}"] = got
    return out


# -- slots of failed versions, freed once no reader maps them ---------------------------------------
FAILURES = 3
SLOW_S = 3.0  # the reader's first bucket takes this long: the writer gives up on the version first
SEND_DEADLINE = 1.0
DETACH_S = 0.3


def mapped_slot_segments() -> int:
    """Host slot segments this process still maps (leaked ones show as deleted files)."""
    gc.collect()
    with open("/proc/self/maps") as maps:
        return len(
            {
                line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                for line in maps
                if "rlfleet-ipcslots" in line
            }
        )


class SlowFirstBucket(RecordingConsumer):
    """Holds bucket 0 (the slot) for `SLOW_S` seconds: a reader still reading when the writer fails."""

    def consume(self, index: int, data: Any) -> None:
        if index == 0:
            time.sleep(SLOW_S)  # a late reader (simulated work while the slot is held)
        super().consume(index, data)


def scenario_ipc_writer_slots(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """`FAILURES` versions fail on the writer (its deadline) while the reader still reads a slot,
    so each failed channel is closed with its slots still mapped; the reader then leaves each
    channel. The writer must free those slots once the reader left, not keep them for good."""
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {"held": [], "mapped": []}
    if rank == 0:
        writer = IpcChannelWriter(detach_timeout_s=DETACH_S)
        for attempt in range(FAILURES):
            name = writer.channel(["r0"], layout, "host")
            w._publish_name(f"{path}.{attempt}", name)
            w._read_name(f"{path}.{attempt}.attached")  # the short deadline is for the version only
            out[f"send{attempt}"] = w.outcome(
                lambda n=name: writer.send(n, w.make_state(1), 1, Deadline(SEND_DEADLINE))
            )
            w._read_name(f"{path}.{attempt}.left")  # the reader left that channel
        out["held"] = writer.held_slots
        out["mapped"] = mapped_slot_segments()
        name = writer.channel(["r0"], layout, "host")  # a channel after the failures still works
        w._publish_name(f"{path}.ok", name)
        out["ok"] = w.outcome(lambda: writer.send(name, w.make_state(2), 2, Deadline(w.DEADLINE)))
        w._read_name(f"{path}.ok.left")
        writer.close()
        out["held_after_close"] = writer.held_slots
        out["mapped_after_close"] = mapped_slot_segments()
        return out
    for attempt in range(FAILURES):
        receiver = CudaIpcReceiver.attach(w._read_name(f"{path}.{attempt}"), 0)
        w._publish_name(f"{path}.{attempt}.attached", "attached")
        consumer = SlowFirstBucket(layout, w.make_state(0))
        out[f"receive{attempt}"] = w.outcome(lambda r=receiver, c=consumer: r.receive(c, w.DEADLINE))
        receiver.close()
        w._publish_name(f"{path}.{attempt}.left", "left")
    receiver = CudaIpcReceiver.attach(w._read_name(f"{path}.ok"), 0)
    consumer = RecordingConsumer(layout, w.make_state(0))
    out["ok"] = w.outcome(lambda: receiver.receive(consumer, w.DEADLINE))
    out["checksum"] = checksum(consumer.weights)
    receiver.close()
    w._publish_name(f"{path}.ok.left", "left")
    return out
