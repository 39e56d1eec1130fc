"""Node-affinity routing: keep a request on the node its environment runs on."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from typing_extensions import Unpack

from rlfleet.routing._base import Router
from rlfleet.routing._index import LoadHeap
from rlfleet.routing._public import public
from rlfleet.routing._worker import RouterOptions, W, WorkerState, check_many, public_router

KeyToNode = Mapping[Any, Hashable] | Callable[[Hashable], Hashable | None]
ComponentDistribution = Mapping[Hashable, Mapping[str, Any]]


@public
def parse_env_index(env_id: object) -> int | None:
    """The env worker index in a seed env id `"<name>-<idx>"` (None if there is none).

    As the seed: `int(env_id.rsplit("-", 1)[-1])`. An int is taken as the index itself.
    """
    if isinstance(env_id, int) and not isinstance(env_id, bool):
        return env_id
    if not isinstance(env_id, str):
        return None
    try:
        return int(env_id.rsplit("-", 1)[-1])
    except ValueError:
        return None


def _ids(distribution: ComponentDistribution, node: Hashable, component: str) -> list[int]:
    comps = distribution[node]
    if not isinstance(comps, Mapping):
        raise ValueError(f"component_distribution[{node!r}] must be a mapping, got {comps!r}")
    entry = comps.get(component, {})
    if not isinstance(entry, Mapping):
        raise ValueError(f"component_distribution[{node!r}][{component!r}] must be a mapping, got {entry!r}")
    out: list[int] = []
    for raw in entry.get("ids", []):
        try:
            out.append(int(raw))
        except (TypeError, ValueError):
            raise ValueError(
                f"component_distribution[{node!r}][{component!r}]['ids'] holds {raw!r}, not an int"
            ) from None
    return out


@public
def env_nodes_from_distribution(component_distribution: ComponentDistribution) -> dict[int, Hashable]:
    """env worker index -> node, from `{node: {"env": {"ids": [...]}, ...}}` (the seed's shape)."""
    out: dict[int, Hashable] = {}
    for node in component_distribution:
        for idx in _ids(component_distribution, node, "env"):
            if idx in out and out[idx] != node:
                raise ValueError(f"env worker {idx} is placed on two nodes: {out[idx]!r} and {node!r}")
            out[idx] = node
    return out


@public
class EnvAffinity:
    """Key -> node for seed env ids: parses `"<name>-<idx>"` and looks the index up."""

    __slots__ = ("env_nodes",)

    def __init__(self, env_nodes: Mapping[int, Hashable]) -> None:
        self.env_nodes = dict(env_nodes)

    def __call__(self, key: Hashable) -> Hashable | None:
        idx = parse_env_index(key)
        return None if idx is None else self.env_nodes.get(idx)

    def __repr__(self) -> str:
        return f"EnvAffinity({self.env_nodes!r})"


@public
def env_affinity(component_distribution: ComponentDistribution) -> EnvAffinity:
    """The key -> node callable for seed env ids placed by `component_distribution`."""
    return EnvAffinity(env_nodes_from_distribution(component_distribution))


@public
def worker_nodes_from_distribution(
    component_distribution: ComponentDistribution, workers: Sequence[W]
) -> dict[W, Hashable]:
    """worker -> node: `component_distribution[node]["eval"]["ids"]` index into `workers`."""
    out: dict[W, Hashable] = {}
    for node in component_distribution:
        for idx in _ids(component_distribution, node, "eval"):
            if not 0 <= idx < len(workers):
                raise ValueError(
                    f"component_distribution[{node!r}]['eval'] names worker {idx}, "
                    f"but there are {len(workers)} worker(s)"
                )
            worker = workers[idx]
            if worker in out and out[worker] != node:
                raise ValueError(f"eval worker {idx} is placed on two nodes: {out[worker]!r} and {node!r}")
            out[worker] = node
    return out


class _Node:
    __slots__ = ("heap", "lock", "name", "total")

    def __init__(self, name: Hashable | None) -> None:
        self.name = name
        self.lock = threading.Lock()
        self.heap: LoadHeap[Any] = LoadHeap()
        self.total = 0  # requests in flight on this node's workers


@public_router
class NodeAffinityRouter(Router[W]):
    """Send a request to the least-loaded candidate on its key's node; anywhere if none.

    `key_to_node` (a mapping or a callable) names the node of a key (an env id); each worker
    is added on a node (`worker_nodes`, or `add_worker(..., node=...)`). A key whose node has
    no candidate, an unknown key and `None` fall back to the least-loaded candidate of any
    node. With `prefer_newest_version=True` a key stays on its node whatever recent versions its
    workers serve (newest first among them); with "strict" the newest version comes first.
    Each node has its own lock, so requests for different nodes never contend; only
    membership changes take every lock.

    Options of this router (keywords):
    - key_to_node=None: a mapping or a callable, key -> node (None: every key falls back).
    - worker_nodes=None: a mapping or a callable, worker -> node, for `workers` (None: no node);
      `add_worker(w, node=...)` places later ones. `from_component_distribution` builds both
      from the seed's `{node: {"env": {"ids": [...]}, "eval": {"ids": [...]}}}`.
    """

    _sticky = True

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        key_to_node: KeyToNode | None = None,
        worker_nodes: Mapping[W, Hashable] | Callable[[W], Hashable] | None = None,
        **options: Unpack[RouterOptions],
    ) -> None:
        self._nodes: dict[Hashable | None, _Node] = {}
        if key_to_node is None:
            self._resolve: Callable[[Hashable], Hashable | None] = _no_node
        elif isinstance(key_to_node, Mapping):
            self._resolve = key_to_node.get
        elif callable(key_to_node):
            self._resolve = key_to_node
        else:
            raise TypeError(f"key_to_node must be a mapping or a callable, got {key_to_node!r}")
        check_many(workers, type(self).__name__, "workers")
        super().__init__(**options)
        if worker_nodes is None:
            node_of: Callable[[W], Hashable | None] = _no_node
        elif isinstance(worker_nodes, Mapping):
            node_of = worker_nodes.get
        else:
            node_of = worker_nodes
        for worker in workers:
            self.add_worker(worker, node=node_of(worker))

    @classmethod
    def from_component_distribution(
        cls,
        workers: Sequence[W],
        component_distribution: ComponentDistribution,
        **kwargs: Any,
    ) -> NodeAffinityRouter[W]:
        """The seed's setup: env ids `"<name>-<idx>"` and eval worker indices placed per node."""
        worker_nodes = worker_nodes_from_distribution(component_distribution, workers)
        return cls(
            workers,
            key_to_node=env_affinity(component_distribution),
            worker_nodes=worker_nodes,
            **kwargs,
        )

    # ------------------------------------------------------------------ locking
    @contextmanager
    def _all_nodes_locked(self) -> Iterator[None]:
        with self._lock:
            locks = [n.lock for n in self._nodes.values()]
            for lock in locks:
                lock.acquire()
            try:
                yield
            finally:
                for lock in reversed(locks):
                    lock.release()

    def _exclusive(self) -> Any:
        return self._all_nodes_locked()

    def release(self, worker: W) -> None:
        st = self._states.get(worker)
        if st is None:
            self._count_down(worker, st)  # raises: unknown
        assert st is not None
        node: _Node = st.slot
        with node.lock:  # only this worker's node: releases on other nodes never wait
            if st.selectable and st.load > 0:  # the usual case of `_count_down`, inlined
                st.load -= 1
                node.heap.reindex(st)
            else:
                self._count_down(worker, st)
            node.total -= 1
        if self._wait.count:
            self._wait.wake()

    def _in_flight_now(self) -> int:
        return sum(n.total for n in list(self._nodes.values()))

    def add_worker(self, worker: W, *, node: Any = None, version: int = 0) -> None:
        with self._lock:  # publish the (empty) node first so _exclusive takes its lock too
            if node not in self._nodes:
                self._nodes[node] = _Node(node)
        super().add_worker(worker, node=node, version=version)

    # ------------------------------------------------------------------ hooks
    def _member_add(self, st: WorkerState[W]) -> None:
        st.slot = self._nodes[st.node]

    def _index_add(self, st: WorkerState[W]) -> None:
        st.slot.heap.add(st)

    def _index_remove(self, st: WorkerState[W]) -> None:
        st.slot.heap.remove(st)

    def _on_release(self, st: WorkerState[W]) -> None:
        st.slot.heap.reindex(st)

    # ------------------------------------------------------------------ hot path
    def node_for(self, key: Any) -> Hashable | None:
        """The node `key` maps to (None: no affinity)."""
        return None if key is None else self._resolve(key)

    def _try_select(self, key: Any) -> W | None:
        # One version served (the usual case): no preference to apply. Each step of `_choose`
        # takes the one node lock it needs.
        order = self._groups.order
        st = self._pick_in(key, order[0], self._cap) if len(order) == 1 else self._choose(key, self._pick_in)
        return None if st is None else st.key

    def _try_assign(self, keys: list[Any]) -> list[W] | None:
        return None  # per-node locks: no single lock covers a batch

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        """On the key's node: `group`, or its recent workers (None, see `_pick_recent`); then, for
        a group, the least-loaded worker of any node."""
        node = None if key is None else self._nodes.get(self._resolve(key))
        if node is not None:
            with node.lock:
                st = node.heap.pop_min(group, limit) if group is not None else self._pick_recent(node, limit)
                if st is not None:
                    node.total += 1
                    return st
        return None if group is None else self._anywhere(group, limit)

    def _pick_recent(self, node: _Node, limit: int | None) -> WorkerState[W] | None:
        """A recent worker of `node`: the newest version first up to `limit` (the load bound),
        else the least loaded under `max_in_flight`. The load bound spreads a rolling update's
        requests over versions; it never sends a key off its node while a recent local worker
        can take it (the seed never leaves the node on load either)."""
        heap: LoadHeap[W] = node.heap
        recent = self._groups.order[: self._groups.recent]
        best: tuple[tuple[int, int], int] | None = None
        for g in recent:
            st: WorkerState[W] | None = heap.pop_min(g, limit)
            if st is not None:
                return st
            top = heap.peek_min(g)
            if top is not None and (best is None or top < best[0]):
                best = (top, g)
        if best is None or (self._cap is not None and best[0][0] >= self._cap):
            return None
        return heap.pop_min(best[1], self._cap)

    def _anywhere(self, group: int, limit: int | None) -> WorkerState[W] | None:
        """Least-loaded worker of `group` on any node, taking one node lock at a time."""
        found: list[tuple[tuple[int, int], _Node]] = []
        for node in list(self._nodes.values()):
            with node.lock:
                top = node.heap.peek_min(group)
            if top is not None and (limit is None or top[0] < limit):
                found.append((top, node))
        found.sort(key=lambda f: f[0])
        for _, node in found:
            with node.lock:  # loads may have moved since the peek: take that node's minimum now
                st: WorkerState[W] | None = node.heap.pop_min(group, limit)
                if st is not None:
                    node.total += 1
                    return st
        return None

    @property
    def nodes(self) -> list[Hashable | None]:
        """Nodes workers were added on (None: workers added without a node)."""
        with self._lock:
            return list(self._nodes)


def _no_node(key: object) -> None:
    return None
