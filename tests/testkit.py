"""Helpers the policygroup and e2e suites share: a free port and a multi-node Ray cluster.

Importing this module imports neither ray nor torch (the routing, placement and weightsync
suites run in environments without them); `ray_cluster` imports ray when it starts one.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"  # Ray's pointer to the last cluster it started


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (another process may take it before you do)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _start(nodes: int) -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "resources": {"node0": 100}},
    )
    try:
        for i in range(1, nodes):
            cluster.add_node(num_cpus=1, resources={f"node{i}": 100})
        cluster.wait_for_nodes()
    except BaseException:
        cluster.shutdown()
        raise
    return cluster


@contextlib.contextmanager
def ray_cluster(nodes: int = 3) -> Iterator[Any]:
    """`nodes` raylets on this machine (node i carries the resource "node{i}": 100), joined by
    this process; shut down and forgotten afterwards."""
    import ray

    with contextlib.suppress(FileNotFoundError):
        os.remove(CURRENT_CLUSTER)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    try:
        cluster = _start(nodes)
    except Exception:  # a raylet missed Ray's 30 s registration window on a loaded machine
        cluster = _start(nodes)
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.remove(CURRENT_CLUSTER)


def node_ids() -> dict[str, str]:
    """Label ("node0", "node1", ...) -> Ray node id of the alive nodes of `ray_cluster`."""
    import ray

    out = {}
    for node in ray.nodes():
        if node.get("Alive"):
            out.update(
                {k: node["NodeID"] for k in node.get("Resources", {}) if k[4:].isdigit() and k[:4] == "node"}
            )
    return out


def eval_state(group: Any) -> list[tuple[int, str]]:
    """(version, weight checksum) of every rollout worker of a Ray `PolicyGroup`, in eval_list order."""
    import ray

    versions = ray.get([p.get_weight_version.remote() for p in group.eval_list], timeout=60)
    sums = ray.get([p.get_weight_checksum.remote() for p in group.eval_list], timeout=60)
    return list(zip(versions, sums, strict=True))
