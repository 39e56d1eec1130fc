"""Process groups among their members only, built from a store, with no default group.

`torch.distributed.new_group` is a collective of the whole world: every process of the default
group must call it, in the same order, even the ones that are not members. That rules out a
group formed after a member died (the dead one can never call it), a group formed by its
members alone while the others are busy, and groups created in a different order by different
processes (a trainer that joins two rollout groups as they come up). A `MemberGroup` is built
by its members alone, from a store and a name they agree on, and needs no default group at all
(``dist.is_initialized()`` may be False, or the process may belong to some other world).

Before the group is built every member joins a fresh generation through the store
(`join_generation`), so a member that never comes is named in a `RendezvousTimeoutError` within
the timeout instead of leaving the others inside gloo's (or NCCL's) connect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import Store

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import CommGroupError, RendezvousTimeoutError
from rlfleet.weightsync.dist._rendezvous import build_group, generation_store, join_generation

__all__ = ["MemberGroup", "member_group"]

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True, repr=False, eq=False)
class MemberGroup:
    """A gloo (or nccl) process group among `size` members; ranks are member ranks 0..size-1.

    Build it with `MemberGroup.create`. `process_group` is torch's backend object (collectives
    take its own options, e.g. ``pg.broadcast([t], opts)``); `rank` is this process's member
    rank. `BroadcastSender` / `BroadcastReceiver` accept a MemberGroup as their group.
    """

    process_group: Any
    prefix: str
    rank: int
    size: int
    backend: str

    @classmethod
    def create(
        cls,
        store: Store,
        prefix: str,
        rank: int,
        size: int,
        timeout_s: float,
        backend: str = "gloo",
    ) -> MemberGroup:
        """Join the group named `prefix` in `store` as member `rank` of `size`.

        Every member calls it with the same `prefix` and `size`; a name may be joined again on
        the same store (each join builds under a fresh generation, so an earlier join's keys are
        never read). Within `timeout_s` every member must have joined, or this raises
        `RendezvousTimeoutError` naming the member ranks that did not (a stale or foreign check-in
        key included); `timeout_s` is also the group's own timeout for each collective.
        """
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"member group prefix must be a non-empty string, got {prefix!r}")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"member group {prefix!r}: size must be an int >= 1, got {size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(f"member group {prefix!r}: rank must be in [0, {size}), got {rank!r}")
        if backend not in BACKENDS:
            raise ValueError(f"member group {prefix!r}: backend must be one of {BACKENDS}, got {backend!r}")
        if not timeout_s > 0:
            raise ValueError(f"member group {prefix!r}: timeout_s must be > 0, got {timeout_s!r}")
        base = f"rlfleet/member/{prefix}"
        what = f"member group {prefix!r}"
        roster = join_generation(store, base, rank, range(size), Deadline(timeout_s), what)
        scoped = generation_store(store, base, roster)  # never an earlier generation's keys

        def build() -> Any:
            if backend == "gloo":
                return _c10d.ProcessGroupGloo(scoped, rank, size, timedelta(seconds=timeout_s))
            options = _c10d.ProcessGroupNCCL.Options()  # pragma: no cover - needs GPUs
            options._timeout = timedelta(seconds=timeout_s)
            return _c10d.ProcessGroupNCCL(scoped, rank, size, options)

        return cls(build_group(build, what, roster), prefix, rank, size, backend)

    def __repr__(self) -> str:
        return f"MemberGroup({self.prefix!r}, rank={self.rank}, size={self.size}, backend={self.backend!r})"


def member_group(
    store: Any, prefix: str, ranks: Sequence[int], rank: int, timeout_s: float, backend: str, what: str
) -> MemberGroup:
    """A `MemberGroup` of `ranks` (world ranks); a missing member is named by its world rank."""
    try:
        return MemberGroup.create(store, prefix, list(ranks).index(rank), len(ranks), timeout_s, backend)
    except RendezvousTimeoutError as exc:
        missing = tuple(ranks[m] for m in exc.missing_ranks)
        raise CommGroupError(
            f"{what}: rank(s) {list(missing)} did not join within {timeout_s:.1f}s (seen from rank {rank})",
            missing,
        ) from exc
