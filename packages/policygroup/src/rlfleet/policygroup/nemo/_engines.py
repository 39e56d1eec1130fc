"""Rollout engines as the receiving side of the refit collective (NeMo RL's SGLang refit, made generic).

Engines are described the way NeMo RL describes SGLang's: by how many GPU ranks each has
(`gpu_counts`) and where its first one sits among the engine ranks (`gpu_offsets`; default:
one after another). With the trainers they form one weightsync `MemberGroup` on the store of
the model-update collective (`init_collective`): trainer rank t is member t, engine e's rank r
is member ``train_world_size + offset_e + r``. Any engine that speaks our wire joins it with
``MemberGroup.create(store, RolloutEngines.prefix, member_rank, size, timeout_s)`` and receives
each version with weightsync's `BroadcastReceiver` (source: member 0, the first trainer).

Trainer 0 broadcasts; the other trainers take part and keep nothing. The refit's deadline is a
watchdog (`SyncWatch`) that `stand_down_refit_watchdog` can lift.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlfleet.weightsync import (
    CommGroupError,
    DiscardingConsumer,
    Layout,
    PeerLostError,
    SyncAbortedError,
    SyncTimeoutError,
    SyncWatch,
    WatchedBroadcastReceiver,
    WatchedBroadcastSender,
    member_group,
)

__all__ = ["EngineRefit", "RolloutEngines"]

SENDER = 0  # the member rank that broadcasts: trainer 0


def _ints(values: Any, what: str, minimum: int) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{what} must be a list of ints, got {values!r}")
    out = tuple(values)
    for v in out:
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ValueError(f"{what} must be ints >= {minimum}, got {list(out)}")
    return out


@dataclass(frozen=True)
class RolloutEngines:
    """Trainers plus rollout engines by GPU count and offset: who is which member of the refit group."""

    train_world_size: int
    gpu_counts: tuple[int, ...]
    gpu_offsets: tuple[int, ...]

    @classmethod
    def describe(
        cls, train_world_size: int, gpu_counts: Sequence[int], gpu_offsets: Sequence[int] | None = None
    ) -> RolloutEngines:
        """Check and build; the engines' ranks must tile ``0..N-1`` (no gap, no overlap)."""
        _ints([train_world_size], "train_world_size", 1)
        counts = _ints(gpu_counts, "engine_gpu_counts", 1)
        if not counts:
            raise ValueError("engine_gpu_counts is empty: at least one rollout engine is needed")
        if gpu_offsets is None:
            offsets = tuple(sum(counts[:i]) for i in range(len(counts)))
        else:
            offsets = _ints(gpu_offsets, "engine_gpu_offsets", 0)
            if len(offsets) != len(counts):
                raise ValueError(
                    f"engine_gpu_offsets has {len(offsets)} entries for {len(counts)} engines: "
                    f"{list(offsets)} vs {list(counts)}"
                )
        owner: dict[int, int] = {}
        for engine, (count, offset) in enumerate(zip(counts, offsets, strict=True)):
            for rank in range(offset, offset + count):
                if rank in owner:
                    raise ValueError(f"engine GPU rank {rank} belongs to engines {owner[rank]} and {engine}")
                owner[rank] = engine
        gaps = sorted(set(range(max(owner) + 1)) - set(owner))
        if gaps:
            raise ValueError(f"engine GPU ranks {gaps} belong to no engine (offsets {list(offsets)})")
        return cls(train_world_size, counts, offsets)

    @property
    def engine_ranks(self) -> int:
        return sum(self.gpu_counts)

    @property
    def size(self) -> int:
        """Members of the refit group: every trainer rank and every engine rank."""
        return self.train_world_size + self.engine_ranks

    @property
    def prefix(self) -> str:
        """The group's name on the store (the same for every member of one topology)."""
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]
        return f"refit/engines/{digest}"

    def member_rank(self, engine: int, local_rank: int) -> int:
        """The member rank of engine `engine`'s GPU rank `local_rank`."""
        if not 0 <= engine < len(self.gpu_counts) or not 0 <= local_rank < self.gpu_counts[engine]:
            raise ValueError(f"no GPU rank {local_rank} in engine {engine} ({self.gpu_counts})")
        return self.train_world_size + self.gpu_offsets[engine] + local_rank

    def to_dict(self) -> dict[str, Any]:
        return {
            "train_world_size": self.train_world_size,
            "engine_gpu_counts": list(self.gpu_counts),
            "engine_gpu_offsets": list(self.gpu_offsets),
        }


class EngineRefit:
    """This trainer's side of the refit group with the rollout engines, kept between refits.

    `state` is the transport's JSON-safe bookkeeping (``_refit_transport_state("rollout_engines")``).
    """

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.engines: RolloutEngines | None = None
        self.rank = -1
        self.group: Any = None
        self.watch = SyncWatch("rollout_engines")
        self._ends: dict[str, WatchedBroadcastSender | WatchedBroadcastReceiver] = {}
        self.broken: str | None = None

    def connect(self, engines: RolloutEngines, store: Any, rank: int, backend: str, timeout_s: float) -> bool:
        """Form the group (False: already formed for this topology and still usable)."""
        if not 0 <= rank < engines.train_world_size:
            raise ValueError(f"trainer rank {rank} is outside train_world_size {engines.train_world_size}")
        if engines == self.engines and self.rank == rank and self.group is not None and self.broken is None:
            return False
        if self.watch.in_flight:
            raise CommGroupError("connect_sglang_rollout_engines: a refit to the engines is in flight")
        what = f"refit group of {len(engines.gpu_counts)} rollout engines"
        if self.group is not None:  # leave the old group now: its peers learn it from its sockets
            self.group = None
            self._ends.clear()
            gc.collect()  # a failed sync's traceback may hold it in a reference cycle
        group = member_group(store, engines.prefix, range(engines.size), rank, timeout_s, backend, what)
        self.engines, self.rank, self.group, self.broken = engines, rank, group, None
        self.state.update(
            engines.to_dict(),
            group={"prefix": engines.prefix, "rank": rank, "size": engines.size, "backend": backend},
            sender_rank=SENDER,
            connects=int(self.state.get("connects", 0)) + 1,
            broken=None,
        )
        return True

    def _end(self, layout: Layout) -> WatchedBroadcastSender | WatchedBroadcastReceiver:
        end = self._ends.get(layout.digest)
        if end is None:
            if self.rank == SENDER:
                end = WatchedBroadcastSender(layout, self.group, SENDER, self.watch)
            else:
                end = WatchedBroadcastReceiver(layout, self.group, SENDER, self.watch)
            self._ends = {layout.digest: end}  # one layout at a time: a new one replaces the old
        return end

    def refit(
        self, state_dict: Mapping[str, torch.Tensor], layout: Layout, version: int, timeout_s: float
    ) -> dict[str, Any]:
        """Move `version` to every engine (collective over the trainers); returns what moved."""
        if self.group is None or self.engines is None:
            raise CommGroupError("refit_rollout_engines: connect_sglang_rollout_engines() must come first")
        if self.broken is not None:
            raise CommGroupError(
                f"refit_rollout_engines: the engine group broke ({self.broken}); "
                "call connect_sglang_rollout_engines() again"
            )
        end = self._end(layout)
        what = f"refit of version {version} to {len(self.engines.gpu_counts)} rollout engines"
        try:
            with self.watch.guard(timeout_s, what) as deadline:
                if isinstance(end, WatchedBroadcastSender):
                    stats = end.send(state_dict, version, deadline)
                else:
                    stats = end.receive(DiscardingConsumer(layout, version), deadline)
        except (PeerLostError, SyncTimeoutError, SyncAbortedError) as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            self.state["broken"] = self.broken
            raise
        last: dict[str, Any] = {"version": stats.version, "buckets": stats.buckets}
        last.update(wire_bytes=stats.wire_bytes, seconds=stats.seconds)
        self.state.update(
            version=stats.version,
            layout_digest=layout.digest,
            bucket_bytes=layout.bucket_bytes,
            padded_bytes=layout.padded_bytes,
            refits=int(self.state.get("refits", 0)) + 1,
            last=last,
        )
        return dict(last)
