"""The receive strategies' names, defined once (policygroup's config and the endpoints use these).

"None" applies each version in place, "Double" stages a private copy and swaps it in, "Shared"
reads one shared-memory buffer per node zero-copy, "Sharded" keeps 1/N of each version and
gathers the rest from the node's other receivers when it applies (the seed's names).
"""

from __future__ import annotations

from typing import Literal, cast, get_args

__all__ = ["WEIGHT_BUFFER_STRATEGIES", "WeightBufferStrategy", "check_strategy"]

WeightBufferStrategy = Literal["None", "Double", "Shared", "Sharded"]
WEIGHT_BUFFER_STRATEGIES: tuple[str, ...] = get_args(WeightBufferStrategy)


def check_strategy(name: object, what: str = "weight buffer strategy") -> WeightBufferStrategy:
    """`name` as a strategy, or a ValueError that names it and the valid ones."""
    if name not in WEIGHT_BUFFER_STRATEGIES:
        raise ValueError(f"{what} {name!r} is unknown; valid: {', '.join(WEIGHT_BUFFER_STRATEGIES)}")
    return cast(WeightBufferStrategy, name)
