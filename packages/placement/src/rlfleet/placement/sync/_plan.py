"""`SyncPlan`: one version's weight sync as executable data.

Who sends which buckets to whom, over which transport, after which other steps, and which
processes read each node's shared buffer; with the prediction of every step. Pure data (frozen
dataclasses, JSON round trip), no torch and no ray: policygroup executes it step by step.

Step semantics (what an executor does):

* ``node_buffer``: ``src`` writes ``buckets`` into ``node``'s shared buffer; every ``dst`` reads
  them (binds zero-copy with "Shared", copies into its own buffer otherwise; see `NodeBuffer`).
* ``cuda_ipc``: the same on GPUs: ``src`` exports its device buffer, every ``dst`` maps and reads it.
* ``broadcast``: ``src`` broadcasts ``buckets`` in a group whose members are ``(src, *dst)``.
* ``p2p``: ``src`` sends ``buckets`` to its single ``dst``.
* ``object_store``: ``src`` puts the buckets in an object store every ``dst`` gets them from.

``after`` lists the steps whose bytes a step needs (a read of a node buffer that broadcasts fill).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel

if TYPE_CHECKING:
    from rlfleet.placement.sync._diff import SyncPlanDiff
    from rlfleet.placement.sync._report import SyncReport

__all__ = [
    "READ_MODES",
    "ROLES",
    "SYNC_FORMAT",
    "SYNC_STRATEGIES",
    "TRANSPORTS",
    "NodeBuffer",
    "SyncPlan",
    "SyncProcess",
    "SyncStep",
]

TRANSPORTS: tuple[str, ...] = ("node_buffer", "broadcast", "cuda_ipc", "p2p", "object_store")
GROUP_TRANSPORTS: tuple[str, ...] = ("broadcast", "p2p")  # the steps that run in a process group
ROLES: tuple[str, ...] = ("trainer", "rollout")
READ_MODES: tuple[str, ...] = ("bind", "copy")
#: The weight-buffer strategies a sync plan serves (the seed's three plus "Sharded").
SYNC_STRATEGIES: tuple[str, ...] = ("None", "Double", "Shared", "Sharded")
SYNC_FORMAT = 1

Role = Literal["trainer", "rollout"]


_DEVICE = re.compile(r"(?i)(cpu)(?::\d+)?|(cuda)(?::(\d+))?")


def _device(value: str, pid: str) -> str:
    """The canonical device: "cpu" (any "cpu" or "cpu:N", any case) or "cuda" / "cuda:N"."""
    match = _DEVICE.fullmatch(value)
    if match is None:
        raise SyncPlanError(
            f"process {pid!r}: device must be 'cpu', 'cuda' or 'cuda:N' (any case), got {value!r}"
        )
    if match.group(1):
        return "cpu"
    return "cuda" if match.group(3) is None else f"cuda:{int(match.group(3))}"


def _text(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise SyncPlanError(f"{what} must be a non-empty string, got {value!r}")
    return value


@public
@dataclass(frozen=True)
class SyncProcess:
    """A process taking part in a sync: a trainer (holds the full weights) or a rollout worker.

    ``device`` is "cpu" or a GPU ("cuda", "cuda:0"; any case, and "cpu:N" is the CPU, kept as the
    canonical lower-case name; anything else is refused); ``shard`` is ``(index, count)`` for a Sharded
    rollout worker that keeps ``1 / count`` of the weights. ``machine`` names the physical host
    when several nodes share one (several raylets on a machine, as in a local test cluster):
    they share its network interfaces, so pricing counts their traffic on the same links.
    """

    id: str
    role: Role
    node: str
    device: str = "cpu"
    shard: tuple[int, int] | None = None
    machine: str | None = None

    def __post_init__(self) -> None:
        _text(self.id, "process id")
        if self.role not in ROLES:
            raise SyncPlanError(f"process {self.id!r}: role must be one of {list(ROLES)}, got {self.role!r}")
        _text(self.node, f"process {self.id!r}: node")
        _text(self.device, f"process {self.id!r}: device")
        object.__setattr__(self, "device", _device(self.device, self.id))
        if self.machine is not None:
            _text(self.machine, f"process {self.id!r}: machine")
        if self.shard is not None:
            shard = tuple(self.shard)
            ok = len(shard) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
            if not ok or not 0 <= shard[0] < shard[1]:
                raise SyncPlanError(
                    f"process {self.id!r}: shard must be (index, count) with 0 <= index < count, "
                    f"got {self.shard!r}"
                )
            if self.role != "rollout":
                raise SyncPlanError(f"process {self.id!r}: only rollout workers carry a shard")
            object.__setattr__(self, "shard", shard)

    @property
    def gpu(self) -> bool:
        return self.device != "cpu"

    @property
    def host(self) -> str:
        """Whose network interfaces this process's traffic crosses: its machine, else its node."""
        return self.machine if self.machine is not None else self.node

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "role": self.role,
            "node": self.node,
            "device": self.device,
            "shard": None if self.shard is None else list(self.shard),
            "machine": self.machine,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncProcess:
        shard = data.get("shard")
        return cls(
            data["id"],
            data["role"],
            data["node"],
            data.get("device", "cpu"),
            None if shard is None else tuple(shard),
            data.get("machine"),
        )


@public
@dataclass(frozen=True)
class SyncStep:
    """One transfer of ``buckets`` (``nbytes`` in all) from ``src`` to ``dst`` over ``transport``.

    ``predicted_seconds`` is the step's own time, ``predicted_end`` when it ends counted from the
    start of the sync; ``phases`` splits the prediction (pack, wire, land, control).
    """

    index: int
    transport: str
    src: str
    dst: tuple[str, ...]
    node: str | None
    buckets: tuple[int, ...]
    nbytes: int
    after: tuple[int, ...] = ()
    predicted_seconds: float = 0.0
    predicted_end: float = 0.0
    phases: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "dst", tuple(self.dst))
        object.__setattr__(self, "buckets", tuple(self.buckets))
        object.__setattr__(self, "after", tuple(self.after))
        object.__setattr__(self, "phases", dict(self.phases))

    @property
    def predicted_start(self) -> float:
        return self.predicted_end - self.predicted_seconds

    def signature(self) -> tuple[Any, ...]:
        """What an executor does, without timing or position (used by `SyncPlan.diff`)."""
        return (self.transport, self.src, self.dst, self.node, self.buckets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "transport": self.transport,
            "src": self.src,
            "dst": list(self.dst),
            "node": self.node,
            "buckets": list(self.buckets),
            "nbytes": self.nbytes,
            "after": list(self.after),
            "predicted_seconds": self.predicted_seconds,
            "predicted_end": self.predicted_end,
            "phases": dict(self.phases),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncStep:
        return cls(
            int(data["index"]),
            data["transport"],
            data["src"],
            tuple(data["dst"]),
            data.get("node"),
            tuple(int(b) for b in data["buckets"]),
            int(data["nbytes"]),
            tuple(int(a) for a in data.get("after", ())),
            float(data.get("predicted_seconds", 0.0)),
            float(data.get("predicted_end", 0.0)),
            {str(k): float(v) for k, v in dict(data.get("phases", {})).items()},
        )


@public
@dataclass(frozen=True)
class NodeBuffer:
    """A node's shared weight buffer: who writes it and who reads it ("bind" zero-copy or "copy")."""

    node: str
    writer: str
    readers: tuple[str, ...]
    mode: Literal["bind", "copy"]

    def __post_init__(self) -> None:
        object.__setattr__(self, "readers", tuple(self.readers))
        if self.mode not in READ_MODES:
            raise SyncPlanError(
                f"node buffer of {self.node!r}: mode must be one of {list(READ_MODES)}, got {self.mode!r}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "writer": self.writer, "readers": list(self.readers), "mode": self.mode}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> NodeBuffer:
        return cls(data["node"], data["writer"], tuple(data["readers"]), data["mode"])


@public
@dataclass(frozen=True)
class SyncPlan:
    """One version's sync, executable: processes, steps, node buffers and their prediction.

    ``bucket_bytes[i]`` is bucket ``i``'s size; ``bucket_tensors[i]`` (optional) how many tensors it
    holds. ``topology_source`` says where the cluster description the plan was priced on came from
    (a fallback says so). ``colocated`` marks a seed plan of rollouts sharing trainers' devices.
    """

    strategy: str
    processes: tuple[SyncProcess, ...]
    bucket_bytes: tuple[int, ...]
    layout_digest: str | None
    steps: tuple[SyncStep, ...]
    node_buffers: tuple[NodeBuffer, ...]
    predicted_seconds: float
    lower_bound_seconds: float
    cost: CostModel
    topology_source: str
    name: str = "rlfleet"
    bucket_tensors: tuple[int, ...] | None = None
    colocated: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "processes", tuple(self.processes))
        object.__setattr__(self, "bucket_bytes", tuple(self.bucket_bytes))
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "node_buffers", tuple(self.node_buffers))
        if self.bucket_tensors is not None:
            object.__setattr__(self, "bucket_tensors", tuple(self.bucket_tensors))

    # ------------------------------------------------------------------ queries
    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_bytes)

    def process(self, process_id: str) -> SyncProcess:
        for p in self.processes:
            if p.id == process_id:
                return p
        raise SyncPlanError(f"unknown process {process_id!r} (not in this plan)")

    @property
    def trainers(self) -> tuple[SyncProcess, ...]:
        return tuple(p for p in self.processes if p.role == "trainer")

    @property
    def rollouts(self) -> tuple[SyncProcess, ...]:
        return tuple(p for p in self.processes if p.role == "rollout")

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.node for p in self.processes))

    def tensors_in(self, buckets: Sequence[int]) -> int:
        """Tensors in these buckets (one per bucket when the plan does not know)."""
        if self.bucket_tensors is None:
            return len(buckets)
        return sum(self.bucket_tensors[b] for b in buckets)

    def steps_of(self, process_id: str) -> tuple[SyncStep, ...]:
        """Steps ``process_id`` takes part in (as sender or receiver), in order."""
        return tuple(s for s in self.steps if s.src == process_id or process_id in s.dst)

    def groups(self) -> tuple[tuple[str, ...], ...]:
        """Process groups to create (one per broadcast or p2p step's members), sender first, each
        once, in step order."""
        return tuple(dict.fromkeys((s.src, *s.dst) for s in self.steps if s.transport in GROUP_TRANSPORTS))

    def receives(self) -> dict[str, list[int]]:
        """Buckets each process receives, in step order (a rollout should get each bucket once)."""
        out: dict[str, list[int]] = {}
        for s in self.steps:
            for d in s.dst:
                out.setdefault(d, []).extend(s.buckets)
        return out

    @property
    def digest(self) -> str:
        """sha256 of what executes (processes, buckets, steps without predictions)."""
        body = {
            "strategy": self.strategy,
            "processes": [p.to_dict() for p in self.processes],
            "bucket_bytes": list(self.bucket_bytes),
            "layout_digest": self.layout_digest,
            "steps": [
                [s.index, *s.signature()[:3], s.node, list(s.buckets), list(s.after)] for s in self.steps
            ],
            "node_buffers": [b.to_dict() for b in self.node_buffers],
        }
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=list).encode()).hexdigest()

    # ------------------------------------------------------------------ checks and views
    def validate(self) -> None:
        """Raise SyncPlanError naming the first problem (see `sync._check` for the list)."""
        from rlfleet.placement.sync._check import validate_plan

        validate_plan(self)

    def diff(self, previous: SyncPlan) -> SyncPlanDiff:
        """What changes from ``previous`` to this plan (processes, steps, groups, node buffers)."""
        from rlfleet.placement.sync._diff import diff_plans

        return diff_plans(previous, self)

    def transfer_info(self, objects: Mapping[str, Any]) -> dict[Any, list[dict[str, Any]]]:
        """The seed-shaped ``transfer_info`` of this plan, with ``objects[id]`` for each process."""
        from rlfleet.placement.sync._view import transfer_info_view

        return transfer_info_view(self, objects)

    def router_map(self) -> dict[str, list[str]]:
        """The seed's ``router_map``: each trainer node -> the nodes its version reaches."""
        from rlfleet.placement.sync._view import router_map_view

        return router_map_view(self)

    def to_dot(self, report: SyncReport | None = None) -> str:
        """Graphviz DOT: one cluster per node, edges labelled with transport and bytes."""
        from rlfleet.placement.sync._render import sync_plan_to_dot

        return sync_plan_to_dot(self, report)

    def draw(self, path: str | Path, report: SyncReport | None = None) -> Path:
        """Draw the plan to ``path``: PNG, SVG(Z) or PDF by its suffix, another suffix refused
        (needs matplotlib: ``rlfleet-placement[draw]``)."""
        from rlfleet.placement.sync._render import draw_sync_plan

        return draw_sync_plan(self, Path(path), report)

    # ------------------------------------------------------------------ data
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SYNC_FORMAT,
            "name": self.name,
            "strategy": self.strategy,
            "processes": [p.to_dict() for p in self.processes],
            "bucket_bytes": list(self.bucket_bytes),
            "bucket_tensors": None if self.bucket_tensors is None else list(self.bucket_tensors),
            "layout_digest": self.layout_digest,
            "steps": [s.to_dict() for s in self.steps],
            "node_buffers": [b.to_dict() for b in self.node_buffers],
            "predicted_seconds": self.predicted_seconds,
            "lower_bound_seconds": self.lower_bound_seconds,
            "cost": self.cost.to_dict(),
            "topology_source": self.topology_source,
            "colocated": self.colocated,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SyncPlan:
        """Rebuild a plan from `to_dict` output; malformed data raises SyncPlanError."""
        if not isinstance(data, Mapping):
            raise SyncPlanError(f"SyncPlan.from_dict needs a mapping, got {type(data).__name__}")
        if data.get("format") != SYNC_FORMAT:
            raise SyncPlanError(
                f"unsupported sync plan format {data.get('format')!r} (expected {SYNC_FORMAT})"
            )
        try:
            tensors = data.get("bucket_tensors")
            return cls(
                strategy=data["strategy"],
                processes=tuple(SyncProcess.from_dict(p) for p in data["processes"]),
                bucket_bytes=tuple(int(b) for b in data["bucket_bytes"]),
                layout_digest=data.get("layout_digest"),
                steps=tuple(SyncStep.from_dict(s) for s in data["steps"]),
                node_buffers=tuple(NodeBuffer.from_dict(b) for b in data["node_buffers"]),
                predicted_seconds=float(data["predicted_seconds"]),
                lower_bound_seconds=float(data["lower_bound_seconds"]),
                cost=CostModel.from_dict(data["cost"]),
                topology_source=str(data["topology_source"]),
                name=str(data.get("name", "rlfleet")),
                bucket_tensors=None if tensors is None else tuple(int(t) for t in tensors),
                colocated=bool(data.get("colocated", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SyncPlanError):
                raise
            raise SyncPlanError(f"malformed sync plan data: {type(exc).__name__}: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> SyncPlan:
        try:
            data = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise SyncPlanError(f"sync plan JSON does not parse: {exc}") from None
        return cls.from_dict(data)
