"""Where things run, as Ray sees it: the cluster's nodes, and a worker's node id, node address,
GPU ids and whether it was restarted.

Outside a Ray cluster (a local worker) the answers are those of a single local node. The
device facts themselves (what the device is and holds, profiling, timings) are weightsync's.
"""

from __future__ import annotations

from typing import Any


def _ray() -> Any:
    """The ray module when this process is connected to a cluster, else None."""
    import ray

    return ray if ray.is_initialized() else None


def node_id() -> str:
    ray = _ray()
    return "local" if ray is None else str(ray.get_runtime_context().get_node_id())


def node_ip() -> str:
    ray = _ray()
    return "127.0.0.1" if ray is None else str(ray.util.get_node_ip_address())


def gpu_ids() -> list[int]:
    ray = _ray()
    ids = [] if ray is None else [int(i) for i in ray.get_gpu_ids()]
    return ids or [0]


def was_restarted() -> bool:
    """True in a Ray actor that Ray restarted after its process died.

    Ray's own ``RuntimeContext.was_current_actor_reconstructed`` reads its deprecated
    ``actor_id`` property, so every actor printed a RayDeprecationWarning: this asks the same
    actor table by ``get_actor_id()`` instead.
    """
    ray = _ray()
    actor_id = None if ray is None else ray.get_runtime_context().get_actor_id()
    if actor_id is None:  # not in an actor
        return False
    try:
        from ray._private.state import actors
    except ImportError:  # a Ray that moved it: the public property, its warning silenced
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    info = actors(actor_id=actor_id)
    return bool(info) and info["NumRestarts"] != 0


def ray_nodes() -> list[dict[str, Any]]:
    """`ray.nodes()`, typed."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes


def local_host() -> str | None:
    """127.0.0.1 when every alive Ray node runs on this one machine (tests, laptops), else None."""
    try:
        addresses = {n.get("NodeManagerAddress") for n in ray_nodes() if n.get("Alive")}
    except Exception:
        return None
    return "127.0.0.1" if len(addresses) <= 1 else None
