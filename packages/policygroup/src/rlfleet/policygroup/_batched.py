"""`BatchedData`: the seed's (ids, values) batch, just the part the policy group uses, plus the
weight version behind each value (async RL: a trainer weights or drops stale samples)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BatchedData(Generic[T]):
    """Parallel lists of env ids and values (env returns, policy responses or ObjectRefs).

    A batch `rollout_batch` returns also carries, per value, the weight version of the rollout
    worker that produced it (`versions()`: ints for local policies and the asyncio API, an
    ObjectRef per value for Ray actors, resolved with ``ray.get``).
    """

    __slots__ = ("_ids", "_values", "_versions")

    def __init__(
        self, ids: Sequence[Any], values: Sequence[T], versions: Sequence[Any] | None = None
    ) -> None:
        if len(ids) != len(values):
            raise ValueError(f"BatchedData: {len(ids)} ids but {len(values)} values")
        if versions is not None and len(versions) != len(values):
            raise ValueError(f"BatchedData: {len(values)} values but {len(versions)} versions")
        self._ids = list(ids)
        self._values = list(values)
        self._versions = None if versions is None else list(versions)

    def ids(self) -> list[Any]:
        return self._ids

    def values(self) -> list[T]:
        return self._values

    def versions(self) -> list[Any]:
        """The weight version that produced each value (ObjectRefs for Ray actors)."""
        if self._versions is None:
            raise ValueError(
                "this BatchedData carries no weight versions: only the results of rollout_batch "
                "and rollout_batch_async do"
            )
        return self._versions

    @property
    def has_versions(self) -> bool:
        return self._versions is not None

    def items(self) -> Iterator[tuple[Any, T]]:
        return zip(self._ids, self._values, strict=True)

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"BatchedData({len(self)} items)"
