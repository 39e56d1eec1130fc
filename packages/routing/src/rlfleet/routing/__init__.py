"""rlfleet.routing: which rollout worker serves a request.

Routers over opaque hashable worker keys, thread-safe and asyncio-friendly, counting requests in
flight locally: least-load, round-robin, power-of-two, node-affinity, consistent-hash (bounded
load) and prefix-aware (an approximate radix tree of what each worker caches), all aware of
draining workers and weight versions for rolling updates. Stdlib only (plus typing-extensions).
"""

from rlfleet.routing.__about__ import __version__
from rlfleet.routing._base import Router
from rlfleet.routing._consistent_hash import ConsistentHashRouter, stable_hash
from rlfleet.routing._errors import (
    DrainTimeoutError,
    DuplicateWorkerError,
    NotInFlightError,
    NoWorkerAvailableError,
    RoutingError,
    UnknownWorkerError,
)
from rlfleet.routing._factory import ROLLOUT_MODES, ROUTER_TYPES, create_router
from rlfleet.routing._least_load import LeastLoadRouter, least_load_assign
from rlfleet.routing._node_affinity import (
    EnvAffinity,
    NodeAffinityRouter,
    env_affinity,
    env_nodes_from_distribution,
    parse_env_index,
    worker_nodes_from_distribution,
)
from rlfleet.routing._power_of_two import PowerOfTwoRouter
from rlfleet.routing._prefix_aware import PREFIX_CACHE_ON_NEW_VERSION, PrefixAwareRouter
from rlfleet.routing._request import Request
from rlfleet.routing._round_robin import RoundRobinRouter
from rlfleet.routing._worker import Loads, RouterOptions, VersionPreference

__all__ = [
    "PREFIX_CACHE_ON_NEW_VERSION",
    "ROLLOUT_MODES",
    "ROUTER_TYPES",
    "ConsistentHashRouter",
    "DrainTimeoutError",
    "DuplicateWorkerError",
    "EnvAffinity",
    "LeastLoadRouter",
    "Loads",
    "NoWorkerAvailableError",
    "NodeAffinityRouter",
    "NotInFlightError",
    "PowerOfTwoRouter",
    "PrefixAwareRouter",
    "Request",
    "RoundRobinRouter",
    "Router",
    "RouterOptions",
    "RoutingError",
    "UnknownWorkerError",
    "VersionPreference",
    "__version__",
    "create_router",
    "env_affinity",
    "env_nodes_from_distribution",
    "least_load_assign",
    "parse_env_index",
    "stable_hash",
    "worker_nodes_from_distribution",
]
