"""Router factories shared by the routing tests (imported by conftest and the tests)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from rlfleet.routing import (
    ConsistentHashRouter,
    LeastLoadRouter,
    NodeAffinityRouter,
    PowerOfTwoRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    Router,
    parse_env_index,
)

MakeRouter = Callable[..., Router[Any]]


def _node_affinity(workers: Iterable[Hashable] = (), **kw: Any) -> NodeAffinityRouter[Any]:
    # Two nodes by parity; keys "env-<i>" live on node i % 2.
    return NodeAffinityRouter(
        workers,
        key_to_node=lambda key: None if (i := parse_env_index(key)) is None else i % 2,
        worker_nodes=lambda w: sum(map(ord, str(w))) % 2,
        **kw,
    )


ROUTER_FACTORIES: dict[str, MakeRouter] = {
    "least_load": LeastLoadRouter,
    "round_robin": RoundRobinRouter,
    "power_of_two": PowerOfTwoRouter,
    "consistent_hash": ConsistentHashRouter,
    "node_affinity": _node_affinity,
    "prefix_aware": PrefixAwareRouter,
}
