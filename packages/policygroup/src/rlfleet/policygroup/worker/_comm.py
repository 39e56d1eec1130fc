"""A worker's communication groups: its world, the groups its group plans, and broadcasts over them.

Two kinds of group. World groups (`create_groups(registered=True)`): every rank of the world
creates every group in one order, as torch.distributed groups (weightsync's bounded
`new_group_bounded`), usable by ``dist.*`` collectives. Member groups: only the members build
them (weightsync `MemberGroup`), which still works after another rank died. Every setup step
has a deadline and a rank that does not show up is named (`CommGroupError`).

The broadcast ends over these groups (weightsync `BroadcastSender` / `BroadcastReceiver`) are
kept per group and layout, and dropped with the groups.
"""

from __future__ import annotations

import contextlib
import datetime
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.policygroup.worker._settings import WorkerSettings
from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    CommGroupError,
    Deadline,
    Layout,
    MemberGroup,
    RendezvousTimeoutError,
    SyncStats,
    SyncTimeoutError,
    connect_store,
    host_store,
    join_generation,
    member_group,
    new_group_bounded,
)

_c10d: Any = dist  # TCPStore / PrefixStore are not re-exported for mypy


class ParallelMode(str, enum.Enum):
    """The seed's group kinds (values equal rlfleet.placement's mode names)."""

    GLOBAL = "global"
    INTRA_NODE = "intra_node"
    WEIGHT_TRANSFER = "weight_transfer"  # a rank may be in several groups of this mode
    TRAIN_DATA_PARALLEL = "train_data_parallel"


def _mode(mode: str | ParallelMode | None) -> str | None:
    return mode.value if isinstance(mode, ParallelMode) else mode


def _wait(work: Any, timeout_s: float, what: str) -> None:
    if not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
        raise SyncTimeoutError(f"{what} timed out after {timeout_s:.1f}s")


class WorkerComm:
    """The groups one worker belongs to, by id and by mode, and the broadcast ends built on them."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.rank = 0
        self.store: Any = None
        self.store_port: int | None = None
        self._prefix = ""
        self._groups: dict[str, Any] = {}
        self._ranks: dict[str, tuple[int, ...]] = {}
        self._by_mode: dict[str, str] = {}  # mode -> group id
        self._registered: set[str] = set()  # groups torch.distributed knows (made by every rank)
        self._broadcasts: dict[tuple[str, str, int], BroadcastSender | BroadcastReceiver] = {}
        #: (group id, version) -> what this rank's broadcast of that version sent (`SyncStats`),
        #: until the step call that made it takes it (`take_sent`).
        self.sent: dict[tuple[str, int], SyncStats] = {}
        self._collective_store: Any = None
        self.collective: dict[str, Any] = {}  # init_collective's facts (JSON-safe), for the refit

    # -- the world ----------------------------------------------------------------------
    def host_store(self, host: str) -> tuple[str, int]:
        """Host a fresh rendezvous store here (the would-be rank 0), listening on `host` only."""
        self.store = host_store(host, 0, timeout_s=self.timeout_s)
        self.store_port = int(self.store.port)
        return host, self.store_port

    def init_world(
        self, rank: int, world_size: int, addr: str, port: int, backend: str, timeout_s: float, epoch: str
    ) -> int:
        """Join the world process group; bounded, naming the ranks that did not join."""
        self.destroy()
        timeout = datetime.timedelta(seconds=timeout_s)
        if not (rank == 0 and self.store is not None and self.store_port == port):
            self.store = _c10d.TCPStore(addr, port, None, False, timeout=timeout)
        self._prefix = f"rlfleet/{epoch}"
        try:
            joined = f"{self._prefix}/world/joined"
            join_generation(self.store, joined, rank, range(world_size), timeout_s, "init_distributed_env")
        except RendezvousTimeoutError as exc:
            raise CommGroupError(f"{exc} (seen from rank {rank})", tuple(exc.missing_ranks)) from exc
        pg_store = _c10d.PrefixStore(f"{self._prefix}/pg", self.store)
        dist.init_process_group(backend, store=pg_store, rank=rank, world_size=world_size, timeout=timeout)
        self.rank = rank
        return rank

    def destroy(self) -> None:
        self._groups.clear()
        self._ranks.clear()
        self._by_mode.clear()
        self._registered.clear()
        self._broadcasts.clear()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # best effort
                dist.destroy_process_group()

    # -- groups -------------------------------------------------------------------------
    def _add(self, group_id: str, mode: str, ranks: Sequence[int], group: Any) -> None:
        self._groups[group_id] = group
        self._ranks[group_id] = tuple(ranks)
        if mode != ParallelMode.WEIGHT_TRANSFER.value or mode not in self._by_mode:
            self._by_mode[mode] = group_id

    def create_member_group(
        self, ranks: Sequence[int], mode: str, backend: str, group_id: str, timeout_s: float
    ) -> bool:
        """Build one member group among `ranks` (False: this rank is not one of them)."""
        if self.rank not in ranks:
            return False
        if not dist.is_initialized():
            raise CommGroupError(f"group {group_id!r}: init_distributed_env() must come first")
        prefix = f"{self._prefix}/pg/{group_id}"
        group = member_group(self.store, prefix, ranks, self.rank, timeout_s, backend, f"group {group_id!r}")
        self._add(group_id, mode, ranks, group)
        return True

    def create_groups(
        self, specs: Sequence[Mapping[str, Any]], backend: str, timeout_s: float, registered: bool
    ) -> int:
        """Create the groups `specs` describe, in order; how many this rank belongs to."""
        made = 0
        for spec in specs:
            ranks, group_id, mode = [int(r) for r in spec["ranks"]], str(spec["group_id"]), str(spec["mode"])
            if not registered:
                made += self.create_member_group(ranks, mode, backend, group_id, timeout_s)
                continue
            key = f"{self._prefix}/{group_id}"
            group = new_group_bounded(
                ranks, backend=backend, timeout=timeout_s, join_timeout=timeout_s, key=key
            )
            if self.rank in ranks:
                self._add(group_id, mode, ranks, group)
                self._registered.add(group_id)
                made += 1
        return made

    def group(self, group_id: str) -> Any:
        try:
            return self._groups[group_id]
        except KeyError:
            raise CommGroupError(
                f"rank {self.rank}: no communication group {group_id!r} (have {sorted(self._groups)})"
            ) from None

    def group_ranks(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self._ranks.items()}

    def of_mode(self, mode: str) -> tuple[Any, int]:
        """(the group of `mode` this rank is in, its size), or (None, 0)."""
        group_id = self._by_mode.get(mode)
        return (None, 0) if group_id is None else (self._groups[group_id], len(self._ranks[group_id]))

    def barrier(self, mode: str | None, timeout_s: float) -> None:
        """Barrier over the world (mode None) or over this rank's group of `mode` (if it has one)."""
        if not dist.is_initialized():
            return
        if mode is None:
            _wait(dist.barrier(async_op=True), timeout_s, "barrier on world")
            return
        group, _ = self.of_mode(mode)
        if group is not None:
            member = isinstance(group, MemberGroup)
            work = group.process_group.barrier() if member else dist.barrier(group=group, async_op=True)
            _wait(work, timeout_s, f"barrier on {mode}")

    def allreduce_mean(self, tensors: Sequence[torch.Tensor], mode: str, timeout_s: float) -> None:
        """Average `tensors` in place over this rank's group of `mode` (one flat all-reduce)."""
        group, size = self.of_mode(mode)
        if group is None or size <= 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if isinstance(group, MemberGroup):
            work = group.process_group.allreduce([flat])
        else:
            work = dist.all_reduce(flat, group=group, async_op=True)
        _wait(work, timeout_s, f"all-reduce over {mode}")
        flat.div_(size)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def join_collective(
        self, ip: str, port: int, rank: int, world_size: int, timeout_s: float, backend: str
    ) -> Any:
        """NeMo RL's model-update group at ip:port (rank 0 hosts the store, on `ip` only)."""
        deadline = Deadline(timeout_s)
        try:
            store = connect_store(ip, port, rank, world_size, deadline)
        except RendezvousTimeoutError as exc:
            raise CommGroupError(f"init_collective: {exc}", tuple(exc.missing_ranks)) from exc
        left = max(deadline.remaining_or(timeout_s), 1.0)
        group = member_group(store, "collective", range(world_size), rank, left, backend, "init_collective")
        self._collective_store = store  # kept open while the group lives (rank 0 hosts it)
        return group.process_group

    # -- broadcasts-----------------------------------------------------------------------
    def _src_in(self, group_id: str, world_rank: int) -> int:
        """How weightsync names a rank in `group_id`: its world rank in a world group, its member
        rank in a member group."""
        return world_rank if group_id in self._registered else self._ranks[group_id].index(world_rank)

    def sender(self, group_id: str, layout: Layout, delta: str = "off") -> BroadcastSender:
        """This rank's broadcast sender in `group_id` for `layout` (built once; ``delta="auto"``:
        it keeps its base, and sends deltas when every receiver of the group holds it)."""
        key = (group_id, layout.digest, self.rank)
        end = self._broadcasts.get(key)
        if not isinstance(end, BroadcastSender):
            group = self.group(group_id)
            src = self._src_in(group_id, self.rank)
            end = self._broadcasts[key] = BroadcastSender(layout, group, src, delta=delta)
        return end

    def receiver(self, group_id: str, layout: Layout, src_rank: int) -> BroadcastReceiver:
        """A broadcast receiver from world rank `src_rank` in `group_id` for `layout` (built once)."""
        key = (group_id, layout.digest, src_rank)
        end = self._broadcasts.get(key)
        if not isinstance(end, BroadcastReceiver):
            group = self.group(group_id)
            end = self._broadcasts[key] = BroadcastReceiver(layout, group, self._src_in(group_id, src_rank))
        return end

    def forget_broadcasts(self) -> None:
        """Drop the broadcast ends (a changed model needs new ones); the groups stay."""
        self._broadcasts.clear()
        self.sent.clear()

    def take_sent(self, group_id: str, version: int) -> dict[str, Any] | None:
        """What this rank's broadcast of `version` in `group_id` put on the wire, as plain data
        (bytes, full bytes, the delta's base or None, and ``lacking_ranks``: the world ranks of
        the receivers that lacked the offered base); None if it recorded nothing."""
        stats = self.sent.pop((group_id, version), None)
        if stats is None:
            return None
        full = stats.wire_bytes if stats.base is None else stats.full_bytes or stats.wire_bytes
        return {  # a delta's full size is its buckets' (padding included: what a delta compares)
            "bytes": int(stats.wire_bytes),
            "full_bytes": int(full),
            "base": stats.base,
            "lacking_ranks": [self.world_rank(group_id, r) for r in stats.full_ranks],
        }

    def world_rank(self, group_id: str, rank: int) -> int:
        """The world rank of group rank `rank` in `group_id` (weightsync names a member by its
        rank in the group: a torch group's, or a member group's index)."""
        if group_id in self._registered:
            return int(dist.get_global_rank(self._groups[group_id], rank))
        return self._ranks[group_id][rank]


class CommGroupCalls:
    """The seed's communication-group calls of a worker, over its `WorkerComm` (policygroup's `BasePolicy`
    inherits them; its driver calls them by name)."""

    # Provided by the host class (see `WorkerSettings`; policygroup's `BasePolicy` is one).
    config: WorkerSettings
    device: torch.device
    model: torch.nn.Module
    role: Any
    index: int
    model_update_group: Any
    _comm: WorkerComm
    _node_ip: Callable[[], str]  # this node's address (the host knows its cluster)

    def _get_addr_and_port(self, host: str | None = None) -> tuple[str, int]:
        """Host a fresh rendezvous store here (the would-be rank 0); `host` overrides the node's
        address (127.0.0.1 when every node is on this machine)."""
        return self._comm.host_store(host or self._node_ip())

    def init_distributed_env(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        master_addr: str,
        master_port: int,
        backend: str = "gloo",
        timeout_s: float | None = None,
        epoch: str = "0",
    ) -> int:
        """Join the world process group; bounded, naming the ranks that did not join."""
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        return self._comm.init_world(rank, world_size, master_addr, master_port, backend, timeout_s, epoch)

    def init_single_comm_group(
        self,
        ranks: Sequence[int],
        mode: str | ParallelMode,
        backend: str = "gloo",
        group_id: str | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Create one process group among `ranks` (members only; a rank may be in many groups)."""
        name = str(_mode(mode))
        ranks = [int(r) for r in ranks]
        group_id = group_id or f"{name}/{'-'.join(map(str, ranks))}"
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        return self._comm.create_member_group(ranks, name, backend, group_id, timeout_s)

    def init_comm_groups(
        self, specs: Sequence[Mapping[str, Any]], backend: str, timeout_s: float, registered: bool = False
    ) -> int:
        """Create several groups in order (one RPC per actor); `registered`: every rank of the
        world makes every group, as torch.distributed groups; else members only."""
        return self._comm.create_groups(specs, backend, timeout_s, registered)

    def get_rank(self) -> int:
        return self._comm.rank

    def get_groups(self) -> dict[str, list[int]]:
        return self._comm.group_ranks()

    def dist_barrier(self, mode: str | ParallelMode | None = None, timeout_s: float | None = None) -> None:
        """Barrier over the world (mode None) or over this rank's group of `mode` (if it has one)."""
        self._comm.barrier(_mode(mode), self.config.group_timeout_s if timeout_s is None else timeout_s)

    def init_collective(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        train_world_size: int,
        nccl_peer: str = "nemo",
        rank: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """NeMo RL: join the model-update group of trainers and rollout workers at ip:port (gloo on CPU).

        Trainers take ranks [0, train_world_size); rollout workers follow them.
        """
        if rank is None:
            rank = self.index if self.role == "train" else train_world_size + self.index
        if not 0 <= rank < world_size:
            raise ValueError(f"init_collective: rank {rank} outside world_size {world_size}")
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.model_update_group = self._comm.join_collective(ip, port, rank, world_size, timeout_s, backend)
        facts = {"address": f"{ip}:{port}", "world_size": world_size, "train_world_size": train_world_size}
        self._comm.collective = {**facts, "rank": rank, "backend": backend}

    def allreduce_gradients(self) -> None:
        """Average gradients over the train data-parallel group (call between backward and step)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        mode = ParallelMode.TRAIN_DATA_PARALLEL.value
        self._comm.allreduce_mean(grads, mode, self.config.group_timeout_s)
