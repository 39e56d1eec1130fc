"""Process bodies for the reshard delta tests: deltas point to point, per destination shard.

Two training ranks (TP 2) hold fp32 master shards that move a little each version, as an
optimizer at a small learning rate moves them, and send them cast to the plan's bf16
(``cast=True``) with ``delta="auto"``; two generation ranks (TP 1, DP 2) each receive the whole
model, a slice from each training rank: every (training rank, generation rank) pair carries
the delta of its own slices. Generation rank 0 lands in a DoubleBuffer, rank 1 in a node
buffer (`SharedBuffer`: its free slot is where a delta is rebuilt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import reshard_workers as rw
import torch
from delta_readers import corrupt_newest, double_reader, node_reader
from testkit import outcome
from weightsync_dist_workers import init

from rlfleet.weightsync import (
    Layout,
    ReshardReceiver,
    ReshardSender,
    ReshardStats,
    SharedBuffer,
    SharedBufferReader,
    checksum,
)

CASE = rw.Case("delta", rw.Par(tp=2), rw.Par(tp=1, dp=2), fused_train=False, fused_gen=True)
DEADLINE = 30.0
VERSIONS = range(1, 9)


def master_pieces(specs: Sequence[rw.Spec], version: int) -> dict[str, torch.Tensor]:
    """The trainer's fp32 master pieces at `version`: a fixed start plus `version` small steps
    (most bf16 elements stay bit-identical from one version to the next); integers count up."""
    g = torch.Generator().manual_seed(11)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        for piece, size in spec.pieces:
            shape = rw.piece_shape(spec, size)
            if getattr(torch, spec.dtype).is_floating_point:
                start = torch.randn(shape, generator=g) * 0.02
                step = torch.randn(shape, generator=g) * 2e-6
                out[piece] = start + version * step
            else:
                out[piece] = torch.randint(-(2**40), 2**40, shape, generator=g, dtype=torch.int64) + version
    return out


def served_pieces(specs: Sequence[rw.Spec], version: int) -> dict[str, torch.Tensor]:
    """What the engine serves at `version`: each piece in its plan dtype (bf16, fp32 norms)."""
    dtypes = {piece: getattr(torch, s.dtype) for s in specs for piece, _ in s.pieces}
    return {k: v.to(dtypes[k]) for k, v in master_pieces(specs, version).items()}


def expected(gen_rank: int, version: int) -> dict[str, torch.Tensor]:
    specs = rw.model(CASE.fused_gen)
    return rw.local_state(specs, served_pieces(specs, version), CASE.gen, gen_rank)


def _stats(stats: ReshardStats) -> dict[str, Any]:
    return {
        "base": stats.base,
        "delta_peers": list(stats.delta_peers),
        "nbytes": stats.nbytes,
        "full_bytes": stats.full_bytes,
    }


def _corrupt(shared: SharedBuffer, layout: Layout, name: str) -> None:
    """Flip a bit of tensor `name` in the node buffer's newest slot (the base of the next delta)."""
    from rlfleet.weightsync.layout import bucket_starts

    spec = layout[name]
    corrupt_newest(shared, bucket_starts(layout)[spec.bucket] + spec.offset + 11, 0x40)


def scenario_reshard_delta(rank: int, world: int, port: int) -> dict[str, Any]:
    """Versions 1-8. Generation rank 0 restarts before 4 (a fresh consumer) and goes back to its
    old consumer, which missed version 4, for 5 on; generation rank 1 corrupts its base before 6
    (refused by digest, nobody applies 6); 7 goes full to everybody, 8 is a delta again."""
    init(rank, world, port)
    (group,) = rw.make_groups(CASE, rank) or []
    train_progs, gen_progs = rw.programs(
        rw.model(CASE.fused_train), rw.model(CASE.fused_gen), CASE.train, CASE.gen
    )
    steps: dict[str, Any] = {}
    T = CASE.train.world
    if rank < T:
        specs = rw.model(CASE.fused_train)
        sender = ReshardSender(
            train_progs[rank],
            group,
            bucket_bytes=rw.BUCKET,
            direct_min=rw.DIRECT_MIN,
            cast=True,
            delta="auto",
        )
        for version in VERSIONS:
            shards = rw.local_state(specs, master_pieces(specs, version), CASE.train, rank)
            steps[f"v{version}"] = outcome(lambda sd=shards, v=version: _stats(sender.send(sd, v, DEADLINE)))
        assert sender.delta is not None
        steps["base_bytes"] = sender.delta.base_bytes
        return steps
    g = rank - T
    receiver = ReshardReceiver(gen_progs[g], group, bucket_bytes=rw.BUCKET, direct_min=rw.DIRECT_MIN)
    layout = receiver.program.layout(rw.BUCKET)
    reader: SharedBufferReader | None = None
    consumer: Any
    if g == 0:
        consumer, weights = double_reader(expected(g, 0), layout)
        old = (consumer, weights)
    else:
        consumer, reader, weights = node_reader(layout)
    for version in VERSIONS:
        if g == 0 and version == 4:
            consumer, weights = double_reader(expected(g, 0), layout)  # a restart: version -1, no base
        if g == 0 and version == 5:
            consumer, weights = old  # holds version 3: it missed 4
        if g == 1 and version == 6:
            _corrupt(consumer, layout, "embed")
        result = outcome(lambda c=consumer: _stats(receiver.receive(c, DEADLINE)))
        result["applied"] = consumer.version
        result["exact"] = checksum(weights()) == checksum(expected(g, consumer.version))
        steps[f"v{version}"] = result
    if reader is not None:
        reader.close()
        consumer.close()  # the harness leaves by os._exit (no atexit)
    return steps
