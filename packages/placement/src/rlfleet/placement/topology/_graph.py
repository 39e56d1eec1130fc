"""Cluster topology: hosts, devices, switches and full-duplex links on a networkx graph.

Vertex ids are strings: a host is its node id (``"node0"``), a device is ``"node0/gpu0"``, a switch
inside a node is ``"node0/nvswitch"`` and a fabric switch is its bare id (``"fabric"``). Ids may not
contain ``/`` so these names never collide. Every link is full duplex: ``bandwidth`` (bytes/s) and
``latency`` (s) hold in each direction independently, which is how NVLink, PCIe and NICs behave.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import networkx as nx

from rlfleet.placement._errors import TopologyError
from rlfleet.placement._public import public

__all__ = [
    "DEVICE_KINDS",
    "LINK_KINDS",
    "Device",
    "Link",
    "Port",
    "Switch",
    "TopologyGraph",
]

LINK_KINDS: tuple[str, ...] = ("nvlink", "pcie", "network")
DEVICE_KINDS: tuple[str, ...] = ("gpu", "cpu")

# Route weight = latency + _REF_BYTES / bandwidth: the time to move one reference-sized message, so
# routes prefer fat links (NVLink over PCIe through the host) and break ties on latency.
_REF_BYTES = float(2**20)
_HOST = "@host"  # local name of the host vertex inside a node's signature graph

Route = tuple[tuple[str, str], ...]


@public
@dataclass(frozen=True)
class Device:
    """A GPU or CPU slot that a worker can occupy."""

    node: str
    id: str
    kind: str = "gpu"

    @property
    def vertex(self) -> str:
        return f"{self.node}/{self.id}"


@public
@dataclass(frozen=True)
class Switch:
    """A switch vertex: inside a node (NVSwitch, PCIe switch) when ``node`` is set, else in the fabric."""

    id: str
    node: str | None = None

    @property
    def vertex(self) -> str:
        return self.id if self.node is None else f"{self.node}/{self.id}"


@public
@dataclass(frozen=True)
class Link:
    """A full-duplex link between two vertices; ``bandwidth`` in bytes/s per direction."""

    a: str
    b: str
    kind: str
    bandwidth: float
    latency: float = 0.0


@public
@dataclass(frozen=True)
class Port:
    """A link that leaves a node: ``local`` is inside ``node``, ``remote`` is outside it."""

    node: str
    local: str
    remote: str
    kind: str
    bandwidth: float
    latency: float


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class TopologyGraph:
    """Hosts, devices, switches and links with bandwidths, on a :class:`networkx.Graph`.

    The queries and the checked construction steps of a `Topology` (which adds the constructors
    on top, so the builders below it need not import it). The graph is available as :attr:`graph`
    (vertex attributes ``role`` and ``node``, edge attributes ``kind``, ``bandwidth``, ``latency``).
    Treat it as immutable once built: routes are cached.
    """

    def __init__(self) -> None:
        #: Where this description came from ("spec", "synthetic ...", "ray.nodes() ..."): plans
        #: priced on it report it as their ``topology_source``.
        self.source = "built by hand"
        self._graph: Any = nx.Graph()
        self._nodes: dict[str, list[str]] = {}  # node -> device vertices in declaration order
        self._devices: dict[str, Device] = {}
        self._switches: dict[str, Switch] = {}
        self._owner: dict[str, str | None] = {}  # vertex -> node that contains it (None: fabric)
        self._links: list[Link] = []
        self._ports: dict[str, list[Port]] = {}
        self._internal: dict[str, list[Link]] = {}
        self._edge: dict[tuple[str, str], Link] = {}  # both directions -> the link (fast lookups)
        self._local_name: dict[str, str] = {}  # vertex -> name inside its node ('@host' for the host)
        self._vertex_bw: dict[str, float] = {}  # vertex -> sum of bandwidths of its links
        self._vertex_lat: dict[str, float] = {}  # vertex -> smallest latency of its links
        # caches (the topology is not mutated after construction)
        self._route_cache: dict[tuple[str, str], Route] = {}
        self._sig_of: dict[str, tuple[Any, ...]] = {}
        self._sig_graph: dict[tuple[Any, ...], Any] = {}
        self._sig_paths: dict[tuple[tuple[Any, ...], str], tuple[dict[str, float], dict[str, list[str]]]] = {}
        self._vertex_port: dict[str, Port | None] = {}
        self._port_sig: dict[str, tuple[tuple[str, float, float], ...]] = {}
        self._sig_port: dict[
            tuple[tuple[Any, ...], tuple[tuple[str, float, float], ...], str], int | None
        ] = {}
        self._fabric: Any = None
        self._fabric_paths: dict[tuple[str, str], list[str] | None] = {}

    # ----------------------------------------------------------------- construction
    def _add_vertex(self, vertex: str, owner: str | None, role: str, where: str) -> None:
        if vertex in self._owner:
            raise TopologyError(f"{where}: duplicate id {vertex!r}")
        self._owner[vertex] = owner
        if owner is not None:
            self._local_name[vertex] = _HOST if vertex == owner else vertex[len(owner) + 1 :]
        self._graph.add_node(vertex, role=role, node=owner)

    def _add_node(self, node: str, where: str) -> None:
        self._add_vertex(node, node, "host", where)
        self._nodes[node] = []
        self._ports[node] = []
        self._internal[node] = []

    def _add_device(self, node: str, device: str, kind: str, where: str) -> None:
        if kind not in DEVICE_KINDS:
            raise TopologyError(f"{where}: device kind must be one of {list(DEVICE_KINDS)}, got {kind!r}")
        dev = Device(node, device, kind)
        self._add_vertex(dev.vertex, node, "device", where)
        self._devices[dev.vertex] = dev
        self._nodes[node].append(dev.vertex)

    def _add_switch(self, switch: Switch, where: str) -> None:
        if switch.node is not None and switch.node not in self._nodes:
            raise TopologyError(f"{where}: switch {switch.id!r} names unknown node {switch.node!r}")
        self._add_vertex(switch.vertex, switch.node, "switch", where)
        self._switches[switch.vertex] = switch

    def _add_link(self, link: Link, where: str) -> None:
        for end in (link.a, link.b):
            if end not in self._owner:
                raise TopologyError(f"{where}: unknown endpoint {end!r} (not a node, device or switch)")
        if link.a == link.b:
            raise TopologyError(f"{where}: link from {link.a!r} to itself")
        if link.kind not in LINK_KINDS:
            raise TopologyError(f"{where}: link kind must be one of {list(LINK_KINDS)}, got {link.kind!r}")
        if not _is_number(link.bandwidth) or not math.isfinite(link.bandwidth) or link.bandwidth <= 0:
            raise TopologyError(
                f"{where}: bandwidth must be a positive finite number, got {link.bandwidth!r}"
            )
        if not _is_number(link.latency) or not math.isfinite(link.latency) or link.latency < 0:
            raise TopologyError(
                f"{where}: latency must be a non-negative finite number, got {link.latency!r}"
            )
        if self._graph.has_edge(link.a, link.b):
            raise TopologyError(f"{where}: duplicate link between {link.a!r} and {link.b!r}")
        weight = link.latency + _REF_BYTES / link.bandwidth
        self._graph.add_edge(
            link.a, link.b, kind=link.kind, bandwidth=link.bandwidth, latency=link.latency, w=weight
        )
        self._links.append(link)
        self._edge[(link.a, link.b)] = link
        self._edge[(link.b, link.a)] = link
        for end in (link.a, link.b):
            self._vertex_bw[end] = self._vertex_bw.get(end, 0.0) + link.bandwidth
            self._vertex_lat[end] = min(self._vertex_lat.get(end, math.inf), link.latency)
        oa, ob = self._owner[link.a], self._owner[link.b]
        if oa is not None and oa == ob:
            self._internal[oa].append(link)
        if oa is not None and oa != ob:
            self._ports[oa].append(Port(oa, link.a, link.b, link.kind, link.bandwidth, link.latency))
        if ob is not None and ob != oa:
            self._ports[ob].append(Port(ob, link.b, link.a, link.kind, link.bandwidth, link.latency))

    def to_spec(self) -> dict[str, Any]:
        """The plain-dict form: ``Topology.from_spec(t.to_spec())`` rebuilds an equal topology."""
        devices = self._devices
        return {
            "nodes": [
                {"id": node, "devices": [{"id": devices[v].id, "kind": devices[v].kind} for v in vertices]}
                for node, vertices in self._nodes.items()
            ],
            "switches": [
                {"id": sw.id} if sw.node is None else {"id": sw.id, "node": sw.node}
                for sw in self._switches.values()
            ],
            "links": [
                {"a": ln.a, "b": ln.b, "kind": ln.kind, "bandwidth": ln.bandwidth, "latency": ln.latency}
                for ln in self._links
            ],
        }

    # ----------------------------------------------------------------- queries
    @property
    def graph(self) -> Any:
        """The underlying :class:`networkx.Graph` (do not mutate it)."""
        return self._graph

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(self._nodes)

    @property
    def links(self) -> tuple[Link, ...]:
        return tuple(self._links)

    @property
    def switches(self) -> tuple[Switch, ...]:
        return tuple(self._switches.values())

    def devices(self, node: str | None = None, kind: str | None = None) -> tuple[Device, ...]:
        """Devices in declaration order, optionally of one node and/or one kind."""
        if node is not None:
            self._check_node(node)
            vertices: Sequence[str] = self._nodes[node]
        else:
            vertices = list(self._devices)
        return tuple(self._devices[v] for v in vertices if kind is None or self._devices[v].kind == kind)

    def _check_node(self, node: str) -> None:
        if node not in self._nodes:
            raise TopologyError(f"unknown node {node!r}")

    def device_vertex(self, node: str, device: str) -> str:
        """Vertex id of ``device`` on ``node``; raises TopologyError naming what is unknown."""
        self._check_node(node)
        vertex = f"{node}/{device}"
        if vertex not in self._devices:
            raise TopologyError(f"unknown device {device!r} on node {node!r}")
        return vertex

    def device(self, vertex: str) -> Device:
        try:
            return self._devices[vertex]
        except KeyError:
            raise TopologyError(f"unknown device vertex {vertex!r}") from None

    def node_of(self, vertex: str) -> str | None:
        """The node containing ``vertex`` (``None`` for fabric switches)."""
        try:
            return self._owner[vertex]
        except KeyError:
            raise TopologyError(f"unknown vertex {vertex!r}") from None

    def ports(self, node: str) -> tuple[Port, ...]:
        """Links leaving ``node`` (its NICs), in declaration order."""
        self._check_node(node)
        return tuple(self._ports[node])

    def ingress_bandwidth(self, node: str) -> float:
        """Sum of the bandwidths of links entering ``node``: no plan can feed it faster."""
        return float(sum(p.bandwidth for p in self.ports(node)))

    def device_ingress_bandwidth(self, vertex: str) -> float:
        """Sum of the bandwidths of all links into ``vertex``."""
        self.node_of(vertex)
        return self._vertex_bw.get(vertex, 0.0)

    def min_link_latency(self, vertex: str) -> float:
        """Smallest latency of a link at ``vertex``: nothing reaches it sooner."""
        self.node_of(vertex)
        lat = self._vertex_lat.get(vertex, 0.0)
        return lat if math.isfinite(lat) else 0.0

    def nearest_port(self, vertex: str) -> Port | None:
        """The NIC traffic between ``vertex`` and other nodes uses (``None`` if its node has none)."""
        self.node_of(vertex)
        return self._nearest_port(vertex)

    def link(self, a: str, b: str) -> Link:
        """The link between ``a`` and ``b`` (either order; ``a``/``b`` as declared in the spec)."""
        try:
            return self._edge[(a, b)]
        except KeyError:
            raise TopologyError(f"no link between {a!r} and {b!r}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopologyGraph):
            return NotImplemented
        return self.to_spec() == other.to_spec()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return (
            f"Topology(nodes={len(self._nodes)}, devices={len(self._devices)}, "
            f"switches={len(self._switches)}, links={len(self._links)})"
        )

    # ----------------------------------------------------------------- routing
    def route(self, src: str, dst: str) -> Route:
        """Directed links ``(u, v)`` a transfer from ``src`` to ``dst`` crosses (empty when equal).

        Inside a node: the cheapest path by ``latency + 1 MiB / bandwidth``. Across nodes: from
        ``src`` to its nearest NIC, through the fabric, into ``dst``'s nearest NIC, to ``dst``.
        """
        key = (src, dst)
        cached = self._route_cache.get(key)
        if cached is not None:
            return cached
        route = self._compute_route(src, dst)
        self._route_cache[key] = route
        return route

    def _compute_route(self, src: str, dst: str) -> Route:
        if src not in self._owner or dst not in self._owner:
            raise TopologyError(f"unknown vertex {src if src not in self._owner else dst!r}")
        ns, nd = self._owner[src], self._owner[dst]
        if src == dst:
            return ()
        if ns is not None and ns == nd:
            return _pairs(self._intra_path(ns, src, dst))
        path: list[str] | None = None
        ps = self._nearest_port(src) if ns is not None else None
        pd = self._nearest_port(dst) if nd is not None else None
        if (ns is None or ps is not None) and (nd is None or pd is not None):
            head = [*self._intra_path(ns, src, ps.local), ps.remote] if ns is not None and ps else [src]
            tail = [pd.remote, *self._intra_path(nd, pd.local, dst)] if nd is not None and pd else [dst]
            middle = self._fabric_path(head[-1], tail[0])
            if middle is not None:
                path = head[:-1] + middle + tail[1:]
        if path is None:  # direct node-to-node links, partitioned fabrics, ...: search the whole graph
            try:
                path = nx.dijkstra_path(self._graph, src, dst, weight="w")
            except nx.NetworkXNoPath:
                raise TopologyError(f"no path from {src!r} to {dst!r}") from None
        return _pairs(path)

    def _signature(self, node: str) -> tuple[Any, ...]:
        """Nodes wired identically share a signature, so their routes are computed once."""
        sig = self._sig_of.get(node)
        if sig is None:
            local = self._local_name
            sig = tuple(
                sorted(
                    (*sorted((local[ln.a], local[ln.b])), ln.kind, ln.bandwidth, ln.latency)
                    for ln in self._internal[node]
                )
            )
            self._sig_of[node] = sig
            if sig not in self._sig_graph:
                g = nx.Graph()
                for a, b, _kind, bw, lat in sig:
                    g.add_edge(a, b, w=lat + _REF_BYTES / bw)
                self._sig_graph[sig] = g
        return sig

    def _sssp(self, sig: tuple[Any, ...], local: str) -> tuple[dict[str, float], dict[str, list[str]]]:
        key = (sig, local)
        found = self._sig_paths.get(key)
        if found is None:
            g = self._sig_graph[sig]
            if local in g:
                dist, paths = nx.single_source_dijkstra(g, local, weight="w")
            else:
                dist, paths = {local: 0.0}, {local: [local]}
            found = (dist, paths)
            self._sig_paths[key] = found
        return found

    def _intra_path(self, node: str, src: str, dst: str) -> list[str]:
        if src == dst:
            return [src]
        _dist, paths = self._sssp(self._signature(node), self._local_name[src])
        local_path = paths.get(self._local_name[dst])
        if local_path is None:
            raise TopologyError(f"no path inside node {node!r} from {src!r} to {dst!r}")
        prefix = node + "/"
        return [node if v == _HOST else prefix + v for v in local_path]

    def _nearest_port(self, vertex: str) -> Port | None:
        """The NIC a transfer from/to ``vertex`` uses: the cheapest to reach (first on ties)."""
        if vertex in self._vertex_port:
            return self._vertex_port[vertex]
        node = self._owner[vertex]
        if node is None:
            return None
        ports = self._ports[node]
        sig = self._signature(node)
        port_sig = self._port_sig.get(node)
        if port_sig is None:
            port_sig = tuple((self._local_name[p.local], p.bandwidth, p.latency) for p in ports)
            self._port_sig[node] = port_sig
        key = (sig, port_sig, self._local_name[vertex])
        if key not in self._sig_port:
            dist, _paths = self._sssp(sig, key[2])
            best, best_cost = None, math.inf
            for i, (local, bw, lat) in enumerate(port_sig):
                cost = dist.get(local, math.inf) + lat + _REF_BYTES / bw
                if cost < best_cost:
                    best, best_cost = i, cost
            self._sig_port[key] = best
        index = self._sig_port[key]
        port = None if index is None else ports[index]
        self._vertex_port[vertex] = port
        return port

    def _fabric_path(self, a: str, b: str) -> list[str] | None:
        if a == b:
            return [a]
        if self._owner.get(a) is not None or self._owner.get(b) is not None:
            return None
        key = (a, b)
        if key not in self._fabric_paths:
            if self._fabric is None:
                fabric = nx.Graph()
                fabric.add_nodes_from(v for v, o in self._owner.items() if o is None)
                fabric.add_edges_from(
                    (ln.a, ln.b, {"w": ln.latency + _REF_BYTES / ln.bandwidth})
                    for ln in self._links
                    if self._owner[ln.a] is None and self._owner[ln.b] is None
                )
                self._fabric = fabric
            try:
                self._fabric_paths[key] = nx.dijkstra_path(self._fabric, a, b, weight="w")
            except nx.NetworkXNoPath:
                self._fabric_paths[key] = None
        return self._fabric_paths[key]


def _pairs(path: Sequence[str]) -> Route:
    return tuple(itertools.pairwise(path))
