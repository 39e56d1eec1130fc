"""Process bodies for the wire dtype and delta tests (spawned, so they live in an importable module).

The trainer keeps fp32 weights that move a little each version (`trainer_state`), as an
optimizer at a small learning rate moves them: most bf16 elements stay bit-identical, a few
cross a rounding boundary. Receivers hold bf16 and must equal the trainer's weights cast to
bf16, bit for bit, after every version.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

import torch
from testkit import outcome
from weightsync_dist_workers import init

from rlfleet.weightsync import Layout, checksum

BUCKET = 64 * 1024
DEADLINE = 30.0
WIRE = torch.bfloat16


def trainer_state(version: int) -> dict[str, torch.Tensor]:
    """fp32 weights at `version`: a fixed start plus `version` small steps in a fixed direction;
    an int buffer and an fp32 tensor that is not cast ride along."""
    g = torch.Generator().manual_seed(7)
    sd: dict[str, torch.Tensor] = {}
    for i in range(6):
        shape = (96, 160) if i % 2 else (300,)
        start = torch.randn(*shape, generator=g) * 0.02
        step = torch.randn(*shape, generator=g) * 2e-6
        sd[f"layers.{i}.weight"] = start + version * step
    sd["embed.weight"] = torch.randn(200, 96, generator=g) * 0.02 + version * 1e-6
    sd["count"] = torch.tensor([version, 3], dtype=torch.int64)
    return sd


def wire_layout(bucket: int = BUCKET) -> Layout:
    """The sender's layout: floating tensors travel as bf16, cast from fp32 while packing."""
    return Layout.from_state_dict(trainer_state(0), bucket, wire_dtype=WIRE)


def served(version: int) -> dict[str, torch.Tensor]:
    """What a bf16 engine serves at `version`: the trainer's weights cast to the wire dtype."""
    return {k: v.to(WIRE) if v.is_floating_point() else v.clone() for k, v in trainer_state(version).items()}


def engine_layout(bucket: int = BUCKET) -> Layout:
    """The receiver's layout, from its own bf16 weights: the sender's digest without a cast."""
    return Layout.from_state_dict(served(0), bucket)


def _share_name(path: str, name: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(name)
    os.replace(tmp, path)


def _receiver(kind: str, layout: Layout) -> tuple[Any, Callable[[], dict[str, torch.Tensor]]]:
    """A receiving consumer of `kind` and how to read what it serves."""
    from rlfleet.weightsync import DirectBuffer, DoubleBuffer, SharedBuffer, SharedBufferReader

    if kind == "node":
        shared = SharedBuffer(layout, num_readers=1)
        reader = SharedBufferReader.attach(shared.name)

        def node_weights() -> dict[str, torch.Tensor]:
            if shared.version >= 0:
                reader.wait_for_version(shared.version, 10.0)
            return {k: v.clone() for k, v in reader.tensors().items()} if shared.version >= 0 else {}

        return shared, node_weights
    live = {k: torch.zeros_like(v) for k, v in served(0).items()}
    buffer = DoubleBuffer(live, layout) if kind == "double" else DirectBuffer(live, layout)
    return buffer, lambda: {k: v.clone() for k, v in live.items()}


def scenario_broadcast(rank: int, world: int, port: int, kinds: list[str]) -> dict[str, Any]:
    """Sender rank 0 (fp32 weights, bf16 wire, ``delta="auto"``); rank r receives into
    ``kinds[r - 1]``. Versions 1-3 as they come; rank 1 restarts (a fresh consumer) before 4;
    rank 2 corrupts its base before 6 (refused by digest, nobody applies 6); 7 goes full."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender

    init(rank, world, port)
    steps: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(wire_layout(), None, 0, direct_min=16 * 1024, delta="auto")
        for version in range(1, 9):
            sd = trainer_state(version)

            def one(sd: Mapping[str, torch.Tensor] = sd, version: int = version) -> dict[str, Any]:
                stats = sender.send(sd, version, DEADLINE)
                return {
                    "base": stats.base,
                    "wire": stats.wire_bytes,
                    "full": stats.full_bytes,
                    "full_ranks": list(stats.full_ranks),
                }

            steps[f"v{version}"] = outcome(one)
        return steps
    layout = engine_layout()
    consumer, weights = _receiver(kinds[rank - 1], layout)
    receiver = BroadcastReceiver(layout, None, 0)
    for version in range(1, 9):
        if version == 4 and rank == 1:
            consumer, weights = _receiver(kinds[0], layout)  # a restart: version -1, no base
        if version == 6 and rank == 2:
            _corrupt(consumer)
        result = outcome(lambda c=consumer: receiver.receive(c, DEADLINE).version)
        result["applied"] = consumer.version
        result["exact"] = (
            checksum(weights()) == checksum(served(consumer.version)) if consumer.version > 0 else None
        )
        steps[f"v{version}"] = result
    _close(consumer)
    return steps


def _close(consumer: Any) -> None:
    """A node buffer's segment is unlinked here: the harness leaves by os._exit (no atexit)."""
    close = getattr(consumer, "close", None)
    if close is not None:
        close()


def _corrupt(consumer: Any) -> None:
    """Flip one element of the applied version where the receiver keeps it."""
    from rlfleet.weightsync import SharedBuffer

    if isinstance(consumer, SharedBuffer):
        table = consumer._table  # the test reaches into the node buffer to corrupt its newest slot
        newest = table.newest()
        assert newest is not None
        consumer._slots[newest][100] ^= 0xFF
        return
    consumer.live["layers.0.weight"][5] += 1.0


# -- the wire dtype through the other transports -------------------------------------------------
def scenario_ring_and_ipc(rank: int, world: int, port: int, path: str, transport: str) -> dict[str, Any]:
    """Rank 0 sends fp32 weights as bf16 over a ShmRing or CUDA IPC (host slots) to the others,
    three versions; each receiver lands them in a DoubleBuffer of bf16 weights."""
    from rlfleet.weightsync import (
        CudaIpcReceiver,
        CudaIpcSender,
        DoubleBuffer,
        ShmRingReceiver,
        ShmRingSender,
    )

    steps: dict[str, Any] = {}
    if rank == 0:
        sender: Any
        if transport == "ring":
            sender = ShmRingSender(wire_layout(), num_readers=world - 1, slots=2, checksums=True)
        else:
            sender = CudaIpcSender(wire_layout(), world - 1, backend="host")
        with sender:
            _share_name(path, sender.name)
            for version in (1, 2, 3):
                steps[f"v{version}"] = outcome(
                    lambda v=version: str(sender.send(trainer_state(v), v, DEADLINE))
                )
        return steps
    name = _read_name(path)
    receiver: Any = (
        ShmRingReceiver.attach(name, rank - 1)
        if transport == "ring"
        else CudaIpcReceiver.attach(name, rank - 1)
    )
    live = {k: torch.zeros_like(v) for k, v in served(0).items()}
    buffer = DoubleBuffer(live, engine_layout())
    with receiver:
        for version in (1, 2, 3):
            result = outcome(lambda: receiver.receive(buffer, DEADLINE))
            result["exact"] = checksum(live) == checksum(served(version))
            steps[f"v{version}"] = result
    return steps


def _read_name(path: str) -> str:
    from weightsync_dist_workers import _read_name as read

    return read(path)


def scenario_reshard_cast(rank: int, world: int, port: int) -> dict[str, Any]:
    """TP 2 training ranks holding fp32 shards -> one bf16 generation rank: refused without
    ``cast=True`` (named), cast once per version with it, bit-exact."""
    import reshard_workers as rw

    from rlfleet.weightsync import DoubleBuffer, ReshardReceiver, ReshardSender

    init(rank, world, port)
    case = rw.CASES[0]  # tp2_to_tp1
    groups = rw.make_groups(case, rank)
    assert groups is not None
    specs = rw.model(case.fused_train)
    train_progs, gen_progs = rw.programs(specs, rw.model(case.fused_gen), case.train, case.gen)
    out: dict[str, Any] = {}
    if rank < case.train.world:
        plain = ReshardSender(train_progs[rank], groups, bucket_bytes=rw.BUCKET, direct_min=rw.DIRECT_MIN)
        casting = ReshardSender(
            train_progs[rank], groups, bucket_bytes=rw.BUCKET, direct_min=rw.DIRECT_MIN, cast=True
        )
        for label, version, sender in (("refused", 1, plain), ("v1", 1, casting), ("v2", 2, casting)):
            shards = rw.local_state(specs, rw.full_pieces(specs, version), case.train, rank)
            fp32 = {k: v.float() if v.is_floating_point() else v for k, v in shards.items()}
            out[label] = outcome(lambda s=sender, sd=fp32, v=version: s.send(sd, v, DEADLINE).nbytes)
        return out
    gen_specs = rw.model(case.fused_gen)
    receiver = ReshardReceiver(gen_progs[0], groups, bucket_bytes=rw.BUCKET, direct_min=rw.DIRECT_MIN)
    live = rw.local_state(gen_specs, rw.full_pieces(gen_specs, 0), case.gen, 0)
    buffer = DoubleBuffer(live, receiver.program.layout(rw.BUCKET))
    for label, version in (("refused", 1), ("v1", 1), ("v2", 2)):
        result = outcome(lambda: receiver.receive(buffer, DEADLINE).version)
        expected = rw.local_state(gen_specs, rw.full_pieces(gen_specs, version), case.gen, 0)
        result["exact"] = checksum(live) == checksum(expected)
        out[label] = result
    return out


# -- kill points: encode, wire, apply, commit -------------------------------------------------
KILL_VERSION = 3


def _killing(kind: str, point: str, layout: Layout) -> tuple[Any, Callable[[], dict[str, torch.Tensor]]]:
    """A DoubleBuffer whose process dies rebuilding a delta bucket of version 3 ("apply") or
    preparing its commit ("commit"); any other point: a plain one."""
    from rlfleet.weightsync import DoubleBuffer

    class Killing(DoubleBuffer):
        def _rebuilding(self, index: int) -> None:
            if point == "apply" and self.pending_version == KILL_VERSION and index > 0:
                os.kill(os.getpid(), signal.SIGKILL)

        def copy_base(self, index: int, out: torch.Tensor) -> bool:
            self._rebuilding(index)
            return super().copy_base(index, out)

        def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
            self._rebuilding(index)  # a host rebuild reads its base here (no copy first)
            return super().base_pieces(index)

        def prepare_commit(self, version: int, deadline: Any = None) -> None:
            if point == "commit" and version == KILL_VERSION:
                os.kill(os.getpid(), signal.SIGKILL)
            super().prepare_commit(version, deadline)

    live = {k: torch.zeros_like(v) for k, v in served(0).items()}
    return Killing(live, layout), lambda: {k: v.clone() for k, v in live.items()}


def scenario_kill_point(rank: int, world: int, port: int, point: str) -> dict[str, Any]:
    """Sender rank 0 (bf16 deltas), receivers 1 (the victim of "apply" / "commit") and 2 (a node
    buffer). Versions 1 (full) and 2 (a delta) go through; version 3 is a delta during which
    the sender dies packing and encoding its first bucket ("encode"), or its last one with the
    others on the wire ("wire"), or receiver 1 dies rebuilding a bucket ("apply") or preparing
    its commit ("commit"). The survivors report what they serve."""
    from weightsync_dist_workers import FlakyMapping

    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender

    init(rank, world, port, timeout=20.0)
    steps: dict[str, Any] = {}
    if rank == 0:
        layout = wire_layout()
        sender = BroadcastSender(layout, None, 0, direct_min=16 * 1024, delta="auto")
        for version in (1, 2, 3):
            sd: Mapping[str, torch.Tensor] = trainer_state(version)
            if version == KILL_VERSION and point in ("encode", "wire"):
                bucket = layout.buckets[0] if point == "encode" else layout.buckets[-1]
                sd = FlakyMapping(sd, bucket.tensors[-1].name, 0, "kill")
            result = outcome(lambda s=sd, v=version: sender.send(s, v, 15.0).base)
            steps[f"v{version}"] = result
        assert sender.delta is not None
        steps["offer_after"] = sender.delta.offer()
        return steps
    layout = engine_layout()
    consumer, weights = _killing("double", point, layout) if rank == 1 else _receiver("node", layout)
    receiver = BroadcastReceiver(layout, None, 0)
    for version in (1, 2, 3):
        result = outcome(lambda c=consumer: receiver.receive(c, 15.0).version)
        result["applied"] = consumer.version
        result["exact"] = checksum(weights()) == checksum(served(consumer.version))
        steps[f"v{version}"] = result
    _close(consumer)
    return steps
