"""Processes and buckets the sync-plan and schedule tests share (a small cluster of each shape)."""

from __future__ import annotations

from rlfleet.placement import SyncProcess

MiB = 2**20
BUCKETS = [64 * MiB, 32 * MiB, 64 * MiB, 16 * MiB, 64 * MiB, 48 * MiB]


def T(pid: str, node: str, device: str = "cpu") -> SyncProcess:
    return SyncProcess(pid, "trainer", node, device)


def R(pid: str, node: str, device: str = "cpu", shard: tuple[int, int] | None = None) -> SyncProcess:
    return SyncProcess(pid, "rollout", node, device, shard)


def cluster(trainers: int) -> list[SyncProcess]:
    """n0: trainer t0 and one rollout; t1, t2, ... on trainer-only nodes; n1, n2: rollout workers."""
    procs = [T(f"t{i}", "n0" if i == 0 else f"nt{i}") for i in range(trainers)]
    procs += [R("r0", "n0"), R("r1", "n1"), R("r2", "n1"), R("r3", "n2"), R("r4", "n2"), R("r5", "n2")]
    return procs
