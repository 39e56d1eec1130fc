"""Process bodies for test_landing.py: gloo receivers whose buffers offer landing targets.

Rank 0 sends; ranks 1-4 receive into the four receiving strategies that offer targets, each
wrapped to record which targets it handed out and whether the transport then handed the same
storage back to ``consume`` (proof that the bytes landed there, not in a bucket buffer).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import weightsync_dist_workers as dw

from rlfleet.weightsync import DirectBuffer, DoubleBuffer, Layout, checksum

DEADLINE = 30.0
#: Receiver kinds by rank (rank 0 is the sender).
KINDS = {1: "direct-atomic", 2: "direct-in-place", 3: "double-copy", 4: "double-swap"}
#: Tensors that travel as their own segment (>= DIRECT_MIN bytes) and are contiguous on receivers.
LANDABLE = {"embed.weight", "big.fp32", "big.int64", "big.bool", "big.bf16"}
#: The bytes of "embed.weight" on the wire (the segment a corrupting sender flips a bit in).
EMBED_NBYTES = 300 * 128 * 2


def landing_state(version: int) -> dict[str, torch.Tensor]:
    """`make_state` (bf16, fp32, int64, bool, fp8, empty, scalar, a transposed source) plus
    large int64 / bool / bf16 tensors that travel direct, the last one in the last bucket."""
    sd = dict(dw.make_state(version))
    g = torch.Generator().manual_seed(5000 + version)
    sd["big.int64"] = torch.randint(-(2**62), 2**62, (3000,), generator=g, dtype=torch.int64)
    sd["big.bool"] = torch.rand(20000, generator=g) > 0.5
    sd["big.bf16"] = torch.randn(160, 64, generator=g).to(torch.bfloat16)
    return sd


def receiver_live() -> dict[str, torch.Tensor]:
    """A receiver's live tensors before the first sync: version 0, "transposed" non-contiguous."""
    return {k: v.clone() if v.is_contiguous() else v.t().clone().t() for k, v in landing_state(0).items()}


class _Recorder:
    """Records every target handed out (by data_ptr) and every ``consume`` at that storage."""

    def _record_init(self) -> None:
        self.bucket_ptrs: dict[int, int] = {}
        self.tensor_ptrs: dict[str, int] = {}
        self.landed_buckets: set[int] = set()
        self.handed_outside: list[str] = []

    def _note_bucket(self, index: int, target: torch.Tensor | None) -> None:
        if target is not None:
            self.bucket_ptrs[index] = target.data_ptr()

    def _note_tensor(self, name: str, target: torch.Tensor | None) -> None:
        if target is not None:
            self.tensor_ptrs[name] = target.data_ptr()

    def _note_consume(self, index: int, data: torch.Tensor) -> None:
        if self.bucket_ptrs.get(index) == data.data_ptr():
            self.landed_buckets.add(index)

    def reset_records(self) -> None:
        self._record_init()


class RecordingDirect(_Recorder, DirectBuffer):
    def __init__(self, live: Mapping[str, torch.Tensor], layout: Layout, **kw: Any) -> None:
        super().__init__(live, layout, **kw)
        self._record_init()

    def bucket_target(self, index: int) -> torch.Tensor | None:
        target = super().bucket_target(index)
        if target is not None:
            staging = self._staging
            assert staging is not None
            assert target.data_ptr() == staging.data_ptr() + self._starts[index], "not the staging"
        self._note_bucket(index, target)
        return target

    def tensor_target(self, name: str) -> torch.Tensor | None:
        target = super().tensor_target(name)
        self._note_tensor(name, target)
        return target

    def consume(self, index: int, data: torch.Tensor) -> None:
        self._note_consume(index, data)
        super().consume(index, data)


class RecordingDouble(_Recorder, DoubleBuffer):
    def __init__(self, live: Mapping[str, torch.Tensor], layout: Layout, **kw: Any) -> None:
        super().__init__(live, layout, **kw)
        self._record_init()

    def bucket_target(self, index: int) -> torch.Tensor | None:
        target = super().bucket_target(index)
        self._note_bucket(index, target)
        return target

    def tensor_target(self, name: str) -> torch.Tensor | None:
        target = super().tensor_target(name)
        if target is not None:
            assert target.data_ptr() == self.staging[name].data_ptr(), "not the staging tensor"
        self._note_tensor(name, target)
        return target

    def consume(self, index: int, data: torch.Tensor) -> None:
        self._note_consume(index, data)
        super().consume(index, data)


def make_buffer(
    kind: str, live: dict[str, torch.Tensor], layout: Layout
) -> RecordingDirect | RecordingDouble:
    if kind == "direct-atomic":
        return RecordingDirect(live, layout)
    if kind == "direct-in-place":
        return RecordingDirect(live, layout, max_staging_bytes=0)
    if kind == "double-copy":
        return RecordingDouble(live, layout, mode="copy")
    return RecordingDouble(live, layout, mode="swap")


class CorruptingWire:
    """A sender's wire that flips one byte of the first `nbytes`-byte broadcast (after its crc)."""

    def __init__(self, inner: Any, nbytes: int) -> None:
        self.inner = inner
        self.nbytes = nbytes
        self.done = False
        self._keep: list[torch.Tensor] = []

    @property
    def device(self) -> torch.device:
        return torch.device(self.inner.device)

    @property
    def rank(self) -> int:
        return int(self.inner.rank)

    @property
    def size(self) -> int:
        return int(self.inner.size)

    @property
    def src(self) -> int:
        return int(self.inner.src)

    def broadcast(self, tensor: torch.Tensor) -> Any:
        if not self.done and tensor.dtype == torch.uint8 and tensor.numel() == self.nbytes:
            self.done = True
            bad = tensor.clone()
            bad[:1].bitwise_xor_(0xFF)
            self._keep.append(bad)  # alive until the broadcast is done
            return self.inner.broadcast(bad)
        return self.inner.broadcast(tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> Any:
        return self.inner.all_reduce_sum(tensor)


def _evidence(buffer: RecordingDirect | RecordingDouble, kind: str, layout: Layout) -> dict[str, Any]:
    """Where the last sync's bytes landed, as JSON-safe facts."""
    live = buffer.live
    out: dict[str, Any] = {
        "buckets": len(layout.buckets),
        "bucket_targets": sorted(buffer.bucket_ptrs),
        "landed_buckets": sorted(buffer.landed_buckets),
        "tensor_targets": sorted(buffer.tensor_ptrs),
    }
    if kind == "direct-in-place" or kind == "double-swap":  # the target is the live tensor itself
        out["targets_are_final"] = all(live[n].data_ptr() == p for n, p in buffer.tensor_ptrs.items())
    elif kind == "double-copy":
        assert isinstance(buffer, RecordingDouble)
        out["targets_are_final"] = all(
            buffer.staging[spec.name].data_ptr() == buffer.bucket_ptrs[spec.bucket] + spec.offset
            for spec in layout.tensors
            if spec.nbytes and spec.bucket in buffer.bucket_ptrs
        )
    else:
        out["targets_are_final"] = bool(buffer.bucket_ptrs)
    return out


def scenario_landing(rank: int, world: int, port: int) -> dict[str, Any]:
    """Good syncs, a corrupted bucket, a sender failing midway, then a good sync again."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender
    from rlfleet.weightsync.dist._dist import TorchWire
    from rlfleet.weightsync.protocol._wire import ProtocolSender

    dw.init(rank, world, port)
    layout = dw.layout_of(landing_state(0))
    steps: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, direct_min=dw.DIRECT_MIN)

        def send(sd: Mapping[str, torch.Tensor], version: int, via: Any = sender) -> Any:
            return dw.outcome(lambda: via.send(sd, version, DEADLINE).wire_bytes)

        steps["v1"] = send(landing_state(1), 1)
        sender.checksums = True
        steps["v2"] = send(landing_state(2), 2)
        corrupting = ProtocolSender(
            layout, CorruptingWire(TorchWire(None, 0), EMBED_NBYTES), checksums=True, direct_min=dw.DIRECT_MIN
        )
        steps["corrupt"] = send(landing_state(3), 3, corrupting)
        steps["midway"] = send(dw.FlakyMapping(landing_state(4), "big.bf16", 1, "raise"), 4)
        steps["v5"] = send(landing_state(5), 5)
        return steps

    kind = KINDS[rank]
    receiver = BroadcastReceiver(layout, None, 0)
    buffer = make_buffer(kind, receiver_live(), layout)
    steps["kind"] = kind
    steps["transposed_live_contiguous"] = buffer.live["transposed"].is_contiguous()

    def recv(step: str) -> None:
        buffer.reset_records()
        result = dw.outcome(lambda: receiver.receive(buffer, DEADLINE).version)
        result["applied"] = buffer.version
        result["checksum"] = checksum(buffer.live)
        result["torn"] = bool(getattr(buffer, "torn", False))
        result["evidence"] = _evidence(buffer, kind, layout)
        result["outside"] = [buffer.bucket_target(0) is None, buffer.tensor_target("embed.weight") is None]
        steps[step] = result

    for step in ("v1", "v2", "corrupt", "midway", "v5"):
        recv(step)
    steps["broken"] = receiver.broken
    return steps


def scenario_sender_dies(rank: int, world: int, port: int) -> dict[str, Any]:
    """The sender SIGKILLs itself while packing the last bucket of version 2."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender

    dw.init(rank, world, port, timeout=15.0)
    layout = dw.layout_of(landing_state(0))
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, direct_min=dw.DIRECT_MIN)
        sender.send(landing_state(1), 1, DEADLINE)
        sender.send(dw.FlakyMapping(landing_state(2), "big.bf16", 1, "kill"), 2, DEADLINE)
        return {"unreachable": True}
    kind = KINDS[rank]
    receiver = BroadcastReceiver(layout, None, 0)
    buffer = make_buffer(kind, receiver_live(), layout)
    receiver.receive(buffer, DEADLINE)
    buffer.reset_records()
    result = dw.outcome(lambda: receiver.receive(buffer, 20.0))
    result["kind"] = kind
    result["applied"] = buffer.version
    result["checksum"] = checksum(buffer.live)
    result["torn"] = bool(getattr(buffer, "torn", False))
    result["handed_out"] = len(buffer.bucket_ptrs) + len(buffer.tensor_ptrs)
    result["outside"] = [buffer.bucket_target(0) is None, buffer.tensor_target("embed.weight") is None]
    return result
