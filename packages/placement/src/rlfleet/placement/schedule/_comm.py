"""Communication-group plans: ranks and process groups exactly as the seed's ``init_comm_group`` forms
them, as pure data, with one fix: every transfer item gets its own weight-transfer group.

The seed keeps one group per parallel mode per process, so a sender that serves several items only
keeps the group made last; here each item has its own ``group_id`` and a rank may sit in several.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.placement._errors import PlacementError
from rlfleet.placement._public import public

__all__ = [
    "INTRA_NODE",
    "TRAIN_DATA_PARALLEL",
    "WEIGHT_TRANSFER",
    "CommGroup",
    "CommGroupPlan",
    "RankInfo",
    "plan_comm_groups",
]

INTRA_NODE = "intra_node"
WEIGHT_TRANSFER = "weight_transfer"
TRAIN_DATA_PARALLEL = "train_data_parallel"


@public
@dataclass(frozen=True)
class RankInfo:
    """One process: its global rank and the arguments of ``init_distributed_env``."""

    rank: int
    actor_id: Hashable
    node_id: Hashable
    gpu_id: Any
    local_rank: int
    local_world_size: int


@public
@dataclass(frozen=True)
class CommGroup:
    """A process group: ``ranks`` in the seed's order; ``src_rank`` is the broadcast root if any."""

    group_id: str
    mode: str
    ranks: tuple[int, ...]
    node_id: Hashable | None = None
    src_rank: int | None = None


@public
@dataclass(frozen=True)
class CommGroupPlan:
    """World ranks, per-rank local info and every group to create, in creation order."""

    ranks: tuple[RankInfo, ...]
    groups: tuple[CommGroup, ...]
    rendezvous_rank: int = 0

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def rendezvous_actor(self) -> Hashable | None:
        """The actor whose address and port every rank uses for the env:// rendezvous (rank 0)."""
        return self.ranks[self.rendezvous_rank].actor_id if self.ranks else None

    def rank_of(self, actor_id: Hashable) -> int:
        for info in self.ranks:
            if info.actor_id == actor_id:
                return info.rank
        raise PlacementError(f"unknown actor {actor_id!r}")

    def groups_of(self, rank: int) -> tuple[CommGroup, ...]:
        """The groups ``rank`` belongs to (it still must join every group's creation call)."""
        return tuple(g for g in self.groups if rank in g.ranks)

    def creation_calls(
        self, groups: Iterable[CommGroup], registered: bool = True
    ) -> dict[int, list[dict[str, Any]]]:
        """Per rank, the specs (ranks, mode, group id) of the `groups` it creates, in order.

        `registered`: torch.distributed groups, which every rank of the world creates (as the seed
        forms them); otherwise each group's members alone (standalone groups, which can still be
        made after a rank died).
        """
        calls: dict[int, list[dict[str, Any]]] = {}
        for g in groups:
            spec = {"ranks": list(g.ranks), "mode": g.mode, "group_id": g.group_id}
            for rank in range(self.world_size) if registered else g.ranks:
                calls.setdefault(rank, []).append(spec)
        return calls

    def by_mode(self, mode: str) -> tuple[CommGroup, ...]:
        return tuple(g for g in self.groups if g.mode == mode)

    @property
    def intra_node_groups(self) -> tuple[CommGroup, ...]:
        return self.by_mode(INTRA_NODE)

    @property
    def weight_transfer_groups(self) -> tuple[CommGroup, ...]:
        return self.by_mode(WEIGHT_TRANSFER)

    @property
    def train_group(self) -> CommGroup | None:
        found = self.by_mode(TRAIN_DATA_PARALLEL)
        return found[0] if found else None

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-able when actor, node and gpu ids are)."""
        return {
            "world_size": self.world_size,
            "rendezvous_rank": self.rendezvous_rank,
            "ranks": [
                {
                    "rank": r.rank,
                    "actor_id": r.actor_id,
                    "node_id": r.node_id,
                    "gpu_id": r.gpu_id,
                    "local_rank": r.local_rank,
                    "local_world_size": r.local_world_size,
                }
                for r in self.ranks
            ],
            "groups": [
                {
                    "group_id": g.group_id,
                    "mode": g.mode,
                    "ranks": list(g.ranks),
                    "node_id": g.node_id,
                    "src_rank": g.src_rank,
                }
                for g in self.groups
            ],
        }


def _items(
    transfer: Mapping[Any, Sequence[Mapping[str, Any]]] | Iterable[Mapping[str, Any]] | None,
) -> list[tuple[Hashable | None, int, Mapping[str, Any]]]:
    if transfer is None:
        return []
    out: list[tuple[Hashable | None, int, Mapping[str, Any]]] = []
    if isinstance(transfer, Mapping):
        for node_id, items in transfer.items():
            for i, item in enumerate(items):
                out.append((node_id, i, item))
    else:
        for i, item in enumerate(transfer):
            out.append((None, i, item))
    for node_id, i, item in out:
        if not isinstance(item, Mapping) or "sender" not in item or "receiver" not in item:
            raise PlacementError(
                f"transfer item {i} of {node_id!r} needs 'sender' and 'receiver' keys: {item!r}"
            )
    return out


@public
def plan_comm_groups(
    actors: Sequence[tuple[Hashable, Hashable, Any]],
    transfer: Mapping[Any, Sequence[Mapping[str, Any]]] | Iterable[Mapping[str, Any]] | None = None,
    train_ids: Sequence[Hashable] = (),
    *,
    weight_buffer_strategy: str = "Double",
) -> CommGroupPlan:
    """Plan ranks and groups for ``actors`` = ``[(actor_id, node_id, gpu_id), ...]``.

    ``actors`` is the seed's ``all_policies`` order (train list then eval list; train only when
    colocated). Ranks: nodes in first-seen order, then ascending ``gpu_id`` (stable). Groups, in the
    seed's creation order: one intra-node group per node; one weight-transfer group per item of
    ``transfer`` (a seed ``transfer_info`` dict or a list of items) that has receivers, ranks
    ``[sender] + receivers``, skipped entirely when ``weight_buffer_strategy == "None"`` as in the seed;
    then the train data-parallel group over ``train_ids`` in their order. Rank 0 hosts the rendezvous.
    """
    by_node: dict[Hashable, list[tuple[Hashable, Hashable, Any]]] = {}
    seen: set[Hashable] = set()
    for i, entry in enumerate(actors):
        if not isinstance(entry, (tuple, list)) or len(entry) != 3:
            raise PlacementError(f"actors[{i}] must be (actor_id, node_id, gpu_id), got {entry!r}")
        actor_id, node_id, gpu_id = entry
        if actor_id in seen:
            raise PlacementError(f"actors[{i}]: duplicate actor id {actor_id!r}")
        seen.add(actor_id)
        by_node.setdefault(node_id, []).append((actor_id, node_id, gpu_id))
    ranks: list[RankInfo] = []
    for node_id, node_actors in by_node.items():
        try:
            ordered = sorted(node_actors, key=lambda a: a[2])
        except TypeError:
            raise PlacementError(
                f"gpu ids on node {node_id!r} cannot be compared: {[a[2] for a in node_actors]!r}"
            ) from None
        by_node[node_id] = ordered
        for local_rank, (actor_id, nid, gpu_id) in enumerate(ordered):
            ranks.append(RankInfo(len(ranks), actor_id, nid, gpu_id, local_rank, len(ordered)))
    rank_of = {r.actor_id: r.rank for r in ranks}

    def lookup(actor_id: Hashable, what: str) -> int:
        try:
            return rank_of[actor_id]
        except (KeyError, TypeError):
            raise PlacementError(f"{what} {actor_id!r} is not among the actors") from None

    groups: list[CommGroup] = []
    first = 0
    for node_id, node_actors in by_node.items():
        group_ranks = tuple(range(first, first + len(node_actors)))
        first += len(node_actors)
        groups.append(CommGroup(f"{INTRA_NODE}/{len(groups)}", INTRA_NODE, group_ranks, node_id))
    if weight_buffer_strategy != "None":
        count = 0
        for node_id, i, item in _items(transfer):
            receivers = item["receiver"]
            if not isinstance(receivers, (list, tuple)):
                receivers = [receivers]  # colocated items name one receiver
            if len(receivers) == 0:
                continue
            sender = lookup(item["sender"], f"sender of transfer item {i} of {node_id!r}")
            members = (
                sender,
                *(lookup(r, f"receiver of transfer item {i} of {node_id!r}") for r in receivers),
            )
            groups.append(CommGroup(f"{WEIGHT_TRANSFER}/{count}", WEIGHT_TRANSFER, members, node_id, sender))
            count += 1
    if train_ids:
        members = tuple(lookup(t, "train id") for t in train_ids)
        groups.append(CommGroup(f"{TRAIN_DATA_PARALLEL}/0", TRAIN_DATA_PARALLEL, members))
    return CommGroupPlan(tuple(ranks), tuple(groups), 0)
