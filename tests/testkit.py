"""Helpers every suite may share: packaging checks, a free port, deadline-bounded polling, a
multi-node Ray cluster and the policy groups built on it.

Importing this module imports neither ray nor torch nor any rlfleet package (the routing,
placement and weightsync suites run in environments without some of them); each helper imports
what it needs when it is called.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("routing", "placement", "weightsync", "policygroup")
CURRENT_CLUSTER = "/tmp/ray/ray_current_cluster"  # Ray's pointer to the last cluster it started
#: The suites' six-actor layout on `ray_cluster(3)`: disaggregated plans mix node buffers (node0,
#: node1) and a cross-node broadcast (to node2, which has no trainer).
PLACES = {
    "train0": "node0",
    "train1": "node1",
    "eval0": "node0",
    "eval1": "node1",
    "eval2": "node2",
    "eval3": "node2",
}


def check_packaging(pkg: str) -> None:
    """The packaging facts every rlfleet package keeps: `rlfleet.<pkg>.__version__` is its
    `__about__` version, and `rlfleet` stays an implicit namespace (typed) in every package."""
    module = importlib.import_module(f"rlfleet.{pkg}")
    assert module.__version__ == importlib.import_module(f"rlfleet.{pkg}.__about__").__version__
    for name in PACKAGES:
        src = REPO / "packages" / name / "src"
        assert (src / "rlfleet" / name / "py.typed").is_file(), f"{name} has no py.typed"
        assert not (src / "rlfleet" / "__init__.py").exists(), f"{src}/rlfleet/__init__.py must not exist"


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run one step of a worker process: its value, or its error's type, message, `parameter` and
    `missing` (JSON-safe, to compare in the test process)."""
    try:
        return {"ok": True, "value": fn()}
    except Exception as exc:
        return {
            "ok": False,
            "type": type(exc).__name__,
            "message": str(exc),
            "parameter": getattr(exc, "parameter", None),
            "missing": getattr(exc, "missing", None),
        }


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.01) -> T:
    """Poll `condition` until it returns something true (returned) or `timeout_s` passes
    (AssertionError naming `what`)."""
    end = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= end:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        time.sleep(interval_s)


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


def spawn_actors(
    cls: type, config: Any, places: Mapping[str, str] = PLACES, **options: Any
) -> dict[str, Any]:
    """One Ray actor of `cls` per name in `places` ("train<i>" / "eval<i>": role and index), pinned
    to its node's resource; `options` go to ``.options`` (num_cpus=0 and max_concurrency=16 unless
    given). Returns at once: the caller waits for them to come up."""
    import ray

    remote = ray.remote(cls)
    options = {"num_cpus": 0, "max_concurrency": 16, **options}
    return {
        name: remote.options(resources={node: 1}, **options).remote(
            config=config, role="train" if name.startswith("train") else "eval", index=int(name[-1])
        )
        for name, node in places.items()
    }


def started_actors(
    cls: type, config: Any, places: Mapping[str, str] = PLACES, timeout_s: float = 240.0
) -> dict[str, Any]:
    """`spawn_actors`, then wait (within `timeout_s`) until every one of them answers."""
    import ray

    out = spawn_actors(cls, config, places)
    ray.get([a.is_alive.remote() for a in out.values()], timeout=timeout_s)
    return out


def cluster_config(weight_buffer: Any = None, **overrides: Any) -> Any:
    """The Ray suites' `PolicyConfig`: deadlines sized for a loaded 2-core box (group 20 s, sync
    60 s, rpc 60 s, drain 30 s) unless `overrides` say otherwise, around `weight_buffer`."""
    from rlfleet.policygroup import PolicyConfig, WeightBufferConfig

    timeouts = {
        "group_timeout_s": 20.0,
        "sync_timeout_s": 60.0,
        "rpc_timeout_s": 60.0,
        "drain_timeout_s": 30.0,
    }
    buffer = WeightBufferConfig() if weight_buffer is None else weight_buffer
    return PolicyConfig(weight_buffer=buffer, **{**timeouts, **overrides})


def ready_group(
    train: Sequence[Any],
    evals: Sequence[Any],
    config: Any,
    *,
    colocated: bool = False,
    align_trainers: bool = False,
) -> Any:
    """A `PolicyGroup` of these Ray actors, built as the seed's driver builds one (init, placement,
    buffers, gloo groups) and synced once, so that its rollout workers start from the trainers'
    weights whatever they served before. `align_trainers`: load the first trainer's weights into
    the others first (data-parallel replicas; a restarted or fresh one starts from its own)."""
    import ray

    from rlfleet.policygroup import PolicyGroup, TrainConfig

    group = PolicyGroup(list(train), list(evals), config)
    try:
        group.init(TrainConfig(lr=1e-2))
        if align_trainers:
            state = ray.get(train[0].get_state_dict.remote(), timeout=60)
            ray.get([t.load_state_dict.remote(state) for t in train[1:]], timeout=60)
        group.init_placement_info(is_colocated=colocated)
        group.init_weight_buffer()
        group.init_comm_group("gloo", is_colocated=colocated)
        group.sync_weights()
    except BaseException:
        with contextlib.suppress(Exception):  # the first error is the one to see
            group.shutdown()
        raise
    return group
