"""Measurements of a sync's cost terms in one process, with weightsync's own machinery (a cost
model's calibration, e.g. rlfleet.policygroup's `PolicyGroup.calibrate`, runs them on workers).

`measure_copy_terms` runs small syncs inside this process through a real node buffer
(`SharedBuffer` publish, then `SharedBufferReader.copy_version` into a `DoubleBuffer`): a large
model gives host-memory copy rates, many tiny tensors the cost of handling one tensor, many
buckets the cost of one bucket. `probe_layout` is a one-tensor model of a chosen size, for
timing the broadcast protocol as syncs use it (its receivers discard it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync.buffers._buffers import DoubleBuffer
from rlfleet.weightsync.layout._copy import copy_tensors
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.shm._shared_buffer import SharedBuffer, SharedBufferReader

__all__ = ["measure_copy_terms", "probe_layout"]

MIB = 1 << 20


def _median(fn: Callable[[], float], rounds: int) -> float:
    fn()  # warm: first-touch page faults and allocations are not what a sync pays each time
    return statistics.median(fn() for _ in range(rounds))


def _sync_seconds(state: dict[str, torch.Tensor], bucket_bytes: int, rounds: int) -> tuple[float, float]:
    """(publish, copy out) seconds of one version of `state` through a node buffer."""
    layout = Layout.from_state_dict(state, bucket_bytes)
    live = {k: torch.empty_like(v) for k, v in state.items()}
    target = DoubleBuffer(live, layout, mode="copy")
    version = [0]
    with SharedBuffer(layout, 1, prefix="rlfleet-probe") as writer:
        reader = SharedBufferReader.attach(writer.name, expected_layout=layout, timeout_s=10.0)
        try:

            def once() -> tuple[float, float]:
                version[0] += 1
                start = time.perf_counter()
                writer.publish(state, version[0], Deadline(30.0))
                mid = time.perf_counter()
                reader.copy_version(version[0], target, Deadline(30.0))
                reader.refresh(Deadline(30.0))
                return mid - start, time.perf_counter() - mid

            once()
            runs = [once() for _ in range(rounds)]
        finally:
            reader.close()
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def measure_copy_terms(nbytes: int = 32 * MIB, tensors: int = 2000, rounds: int = 3) -> dict[str, float]:
    """Host copy rate, seconds per tensor and per bucket, from small syncs through a node buffer."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)

    def copy_once() -> float:
        start = time.perf_counter()
        copy_tensors([dst], [src])
        return time.perf_counter() - start

    memcpy = nbytes / _median(copy_once, rounds)
    one = {"w": torch.ones(tensors, dtype=torch.float32)}
    base = sum(_sync_seconds(one, 1 << 30, rounds))
    many = {f"t{i}": torch.ones(1, dtype=torch.float32) for i in range(tensors)}
    per_tensor = max(0.0, sum(_sync_seconds(many, 1 << 30, rounds)) - base) / (2 * tensors)
    buckets = {f"b{i}": torch.ones(1024, dtype=torch.float32) for i in range(64)}
    spread = sum(_sync_seconds(buckets, 4096, rounds))  # one bucket per tensor
    packed = sum(_sync_seconds(buckets, 1 << 30, rounds))  # one bucket for all
    per_bucket = max(0.0, spread - packed) / (2 * 63)
    return {"memcpy_bytes_per_s": memcpy, "per_tensor_s": per_tensor, "per_bucket_s": per_bucket}


def probe_layout(nbytes: int, bucket_bytes: int) -> tuple[Layout, dict[str, torch.Tensor]]:
    """A one-tensor model of `nbytes` for a broadcast probe (the same on every member)."""
    state = {"probe": torch.zeros(nbytes, dtype=torch.uint8)}
    return Layout.from_state_dict(state, bucket_bytes), state
