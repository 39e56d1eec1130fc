"""`BatchedData`: the seed's (ids, values) batch, just the part the policy group uses."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BatchedData(Generic[T]):
    """Parallel lists of env ids and values (env returns, policy responses or ObjectRefs)."""

    __slots__ = ("_ids", "_values")

    def __init__(self, ids: Sequence[Any], values: Sequence[T]) -> None:
        if len(ids) != len(values):
            raise ValueError(f"BatchedData: {len(ids)} ids but {len(values)} values")
        self._ids = list(ids)
        self._values = list(values)

    def ids(self) -> list[Any]:
        return self._ids

    def values(self) -> list[T]:
        return self._values

    def items(self) -> Iterator[tuple[Any, T]]:
        return zip(self._ids, self._values, strict=True)

    def __len__(self) -> int:
        return len(self._ids)

    def __repr__(self) -> str:
        return f"BatchedData({len(self)} items)"
