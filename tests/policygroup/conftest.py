"""A shared 3-node Ray cluster (several raylets on this machine) for the policy-group tests."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import contextlib

import pg_policies

NODES = 3


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with contextlib.suppress(FileNotFoundError):
        os.remove("/tmp/ray/ray_current_cluster")
    ray.cloudpickle.register_pickle_by_value(pg_policies)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "include_dashboard": False,
            "resources": {"node0": 100},
        },
    )
    try:
        for i in range(1, NODES):
            c.add_node(num_cpus=1, resources={f"node{i}": 100})
        c.wait_for_nodes()
        ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.remove("/tmp/ray/ray_current_cluster")


def node_ids() -> dict[str, str]:
    """Label ("node0".."node2") -> Ray node id."""
    import ray

    out = {}
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        for k in n.get("Resources", {}):
            if k.startswith("node") and k[4:].isdigit():
                out[k] = n["NodeID"]
    return out
