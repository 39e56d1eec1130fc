"""A local multi-node Ray cluster for the Ray benchmarks (`ray.cluster_utils.Cluster`).

Node ``i`` carries the custom resource ``node{i}`` (100 units), so a benchmark pins an actor to
a node with ``resources={"node2": 1}``; Ray's pointer to the last cluster it started is removed
before and after, so a stale one never redirects a later ``ray.init``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"


@contextlib.contextmanager
def local_cluster(nodes: int, **node_args: Any) -> Iterator[Any]:
    """`nodes` raylets on this machine, joined by this process; shut down afterwards.

    `node_args` go to every raylet (e.g. ``object_store_memory``); each has one CPU."""
    import ray
    from ray.cluster_utils import Cluster

    def forget() -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(CURRENT_CLUSTER)

    forget()
    with contextlib.ExitStack() as stack:
        stack.callback(forget)
        head = {"num_cpus": 1, "include_dashboard": False, "resources": {"node0": 100}, **node_args}
        cluster = Cluster(initialize_head=True, head_node_args=head)
        stack.callback(cluster.shutdown)
        for i in range(1, nodes):
            cluster.add_node(num_cpus=1, resources={f"node{i}": 100}, **node_args)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        stack.callback(ray.shutdown)
        yield cluster
