"""The transports and the groups of a reshard.

A reshard moves slices point to point: a `P2PWire` is sends, receives and a sum all-reduce over
one group (`TorchP2PWire` over a torch.distributed group, gloo on CPU or nccl on GPU;
`NcclP2PWire` over a cupy NCCL communicator, imported lazily). A `PeerGroup` says who is who in
one group: which training and generation ranks it holds, at which group ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

from rlfleet.weightsync.cuda._cupy import import_nccl
from rlfleet.weightsync.cuda._nccl import NcclPending, NcclWire
from rlfleet.weightsync.dist._dist import GroupMember, TorchPending, map_dist_error
from rlfleet.weightsync.protocol._core import Collective, Pending
from rlfleet.weightsync.reshard._reshard_program import GEN, TRAIN, Peer

__all__ = ["NcclP2PWire", "P2PWire", "PeerGroup", "TorchP2PWire"]


class P2PWire(Collective, Protocol):
    """Point-to-point sends and receives plus a sum all-reduce over one group, on one device."""

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Pending: ...


def _is_torch_group(obj: Any) -> bool:
    """A torch.distributed ProcessGroup, or a backend made directly (``ProcessGroupGloo(store, ...)``)."""
    return isinstance(obj, (dist.ProcessGroup, _c10d.Backend))


def _group_device(group: Any) -> torch.device:
    if isinstance(group, dist.ProcessGroupGloo):
        return torch.device("cpu")
    try:
        backend = str(dist.get_backend(group)).lower()
    except Exception:
        backend = str(getattr(group, "name", lambda: "")()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchP2PWire(GroupMember):
    """A torch.distributed process group (registered or not) as a `P2PWire`; ranks are group ranks."""

    def __init__(self, group: Any = None, device: str | torch.device | None = None) -> None:
        if group is None:
            if not dist.is_initialized():
                raise RuntimeError("torch.distributed is not initialized and no process group was given")
            group = dist.group.WORLD
        if not _is_torch_group(group):
            raise TypeError(f"group must be a torch.distributed ProcessGroup, got {type(group).__name__}")
        self.group: Any = group
        dev = torch.device(device) if device is not None else _group_device(group)
        super().__init__(dev, int(group.rank()), int(group.size()))

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> TorchPending:
        try:
            return TorchPending(self.group.send([tensor], peer, tag), "send")
        except Exception as exc:
            raise map_dist_error(exc, f"send to group rank {peer}") from exc

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> TorchPending:
        try:
            return TorchPending(self.group.recv([tensor], peer, tag), "recv")
        except Exception as exc:
            raise map_dist_error(exc, f"receive from group rank {peer}") from exc

    def all_reduce_sum(self, tensor: torch.Tensor) -> TorchPending:
        try:
            return TorchPending(self.group.allreduce([tensor]), "all_reduce")
        except Exception as exc:
            raise map_dist_error(exc, "all_reduce") from exc


class NcclP2PWire(GroupMember):  # pragma: no cover - needs several GPUs and cupy
    """A cupy NCCL communicator (`NcclWire`: bounded rendezvous, side stream, abort at the
    deadline) as a `P2PWire` for multi-GPU reshards.

    NCCL matches point-to-point operations between two ranks by call order, which the global
    message order guarantees, so tags are not needed. A wait past the deadline aborts the
    communicator (the session is then broken and must be rebuilt).
    """

    def __init__(self, wire: NcclWire) -> None:
        super().__init__(wire.device, wire.rank, wire.size)
        self.base = wire

    @classmethod
    def create(cls, store: Any, rank: int, world_size: int, **options: Any) -> NcclP2PWire:
        """Build the communicator (`NcclWire.create`'s keyword options: device, deadline, name)."""
        options.setdefault("name", "reshard")
        return cls(NcclWire.create(store, rank, world_size, 0, **options))

    def _launch(self, tensor: torch.Tensor, peer: int, op: str) -> NcclPending:
        base, nccl = self.base, import_nccl()
        call = base.comm.send if op == "send" else base.comm.recv
        ptr, count = tensor.data_ptr(), tensor.numel()
        return base.enqueue(tensor, lambda stream: call(ptr, count, nccl.NCCL_UINT8, peer, stream))

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> NcclPending:
        return self._launch(tensor.view(torch.uint8), peer, "send")

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> NcclPending:
        return self._launch(tensor.view(torch.uint8), peer, "recv")

    def all_reduce_sum(self, tensor: torch.Tensor) -> NcclPending:
        return self.base.all_reduce_sum(tensor)


class PeerGroup:
    """One process group of a reshard and who is who in it.

    `members` maps ``("train", r)`` / ``("gen", g)`` to group ranks. Every rank lists its groups
    with the same `key` order. Every generation rank must belong to every group (true for
    `world` and for one group per training pipeline stage, `stage`).
    """

    def __init__(self, wire: P2PWire | dist.ProcessGroup, members: Mapping[Peer, int], key: int = 0) -> None:
        self.wire: P2PWire = TorchP2PWire(wire) if _is_torch_group(wire) else cast(P2PWire, wire)
        self.key = int(key)
        self.members: dict[Peer, int] = {}
        ranks: set[int] = set()
        for (side, r), group_rank in members.items():
            if side not in (TRAIN, GEN):
                raise ValueError(f"group {key}: member side must be {TRAIN!r} or {GEN!r}, got {side!r}")
            if not 0 <= group_rank < self.wire.size or group_rank in ranks:
                raise ValueError(
                    f"group {key}: group rank {group_rank} of {side} rank {r} is invalid or taken"
                )
            ranks.add(group_rank)
            self.members[(side, int(r))] = int(group_rank)
        if len(self.members) != self.wire.size:
            raise ValueError(
                f"group {key}: {len(self.members)} members listed for a group of {self.wire.size}"
            )
        self.labels = {v: k for k, v in self.members.items()}
        trains = sorted(r for side, r in self.members if side == TRAIN)
        self.lead: int | None = trains[0] if trains else None
        self.gens = sorted(r for side, r in self.members if side == GEN)

    @classmethod
    def world(
        cls,
        group: P2PWire | dist.ProcessGroup | None,
        train_world_size: int,
        gen_world_size: int,
        key: int = 0,
    ) -> PeerGroup:
        """One group of everybody: training rank r is group rank r, generation rank g is T + g."""
        wire = TorchP2PWire(group) if group is None or _is_torch_group(group) else group
        members: dict[Peer, int] = {(TRAIN, r): r for r in range(train_world_size)}
        members.update({(GEN, g): train_world_size + g for g in range(gen_world_size)})
        return cls(wire, members, key)

    @classmethod
    def stage(
        cls, group: P2PWire | dist.ProcessGroup, train_ranks: Sequence[int], gen_world_size: int, key: int
    ) -> PeerGroup:
        """One pipeline stage's group: its training ranks (in the given order), then every generation rank."""
        members: dict[Peer, int] = {(TRAIN, int(r)): i for i, r in enumerate(train_ranks)}
        members.update({(GEN, g): len(train_ranks) + g for g in range(gen_world_size)})
        return cls(group, members, key)

    def label(self, group_rank: int) -> str:
        side, r = self.labels[group_rank]
        return f"{side} rank {r}"
