"""Candidate groups: selectable workers counted by the version they serve, newest first."""

from __future__ import annotations


class VersionGroups:
    """What the version preference needs to know about the selectable workers.

    A worker's group is the version it serves (0 for all when versions are ignored). Changed
    under the router's exclusive lock; `order` is replaced, never mutated, so routers that read
    it without that lock (per-node locks) see a consistent list.
    """

    __slots__ = ("counts", "floor", "lag", "order", "recent", "recent_count", "versioned")

    def __init__(self, versioned: bool, lag: int) -> None:
        self.versioned = versioned
        self.lag = lag  # versions behind the newest that still count as recent
        self.counts: dict[int, int] = {}  # selectable workers per group
        self.order: list[int] = []  # groups, newest first
        self.recent = 0  # how many leading groups of `order` are within `lag` of the newest
        self.floor = 0  # the oldest recent group
        self.recent_count = 0  # selectable workers in the recent groups

    def join(self, version: int) -> int:
        """A worker serving `version` became selectable: its group."""
        group = version if self.versioned else 0
        self.counts[group] = self.counts.get(group, 0) + 1
        return group

    def leave(self, group: int) -> None:
        left = self.counts[group] - 1
        if left:
            self.counts[group] = left
        else:
            del self.counts[group]

    def refresh(self) -> None:
        """Recompute the order after joins and leaves."""
        order = sorted(self.counts, reverse=True)
        recent = [g for g in order if g >= order[0] - self.lag] if order else []
        self.floor = recent[-1] if recent else 0
        self.recent_count = sum(self.counts[g] for g in recent)
        self.recent = len(recent)
        self.order = order

    def size(self, group: int | None) -> int:
        """Selectable workers in `group` (None: in the recent groups)."""
        return self.recent_count if group is None else self.counts.get(group, 0)
