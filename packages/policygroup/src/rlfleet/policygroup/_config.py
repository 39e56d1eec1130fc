"""Configuration dataclasses, with the seed's field names and early, named errors for bad combos."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfleet.placement import CostModel, check_sync_options
from rlfleet.routing import PREFIX_CACHE_ON_NEW_VERSION, ROLLOUT_MODES, ROUTER_TYPES
from rlfleet.weightsync import DTYPES, WEIGHT_BUFFER_STRATEGIES, check_strategy
from rlfleet.weightsync.codec import check_delta_mode

__all__ = [
    "BUFFER_STRATEGIES",
    "BUFFER_TYPES",
    "ROLLOUT_MODES",
    "ROUTER_TYPES",
    "PolicyConfig",
    "TrainConfig",
    "WeightBufferConfig",
]

BUFFER_STRATEGIES = WEIGHT_BUFFER_STRATEGIES  # defined once, in rlfleet.weightsync
#: The seed's buffer ``type`` each strategy builds (its `build_weight_buffer` registry names).
TYPE_OF_STRATEGY = {
    "None": "WeightBuffer",
    "Double": "WeightBuffer",
    "Shared": "CPUWeightBuffer",
    "Sharded": "ShardedWeightBuffer",
}
BUFFER_TYPES = tuple(dict.fromkeys(TYPE_OF_STRATEGY.values()))


def _choice(value: object, valid: tuple[str, ...], what: str) -> None:
    if value not in valid:
        raise ValueError(f"{what} {value!r} is unknown; valid: {', '.join(valid)}")


@dataclass
class WeightBufferConfig:
    """How a version reaches the rollout workers: the seed's ``type`` and ``buffer_strategy``,
    and the options of the `SyncPlan` rlfleet.placement makes for them.

    ``buffer_strategy``: "None" applies in place (the receiver is drained), "Double" stages a
    private copy and swaps it in, "Shared" one two-slot node buffer every local rollout worker
    reads zero-copy, "Sharded" keeps 1/N per worker and gathers at apply. ``type`` is the
    seed's buffer class name; it follows from the strategy ("CPUWeightBuffer" for "Shared",
    "ShardedWeightBuffer" for "Sharded", "WeightBuffer" otherwise) and, when given, must agree.
    ``checksums``: a CRC32 per bucket, checked before a version is applied (one more read of the
    model). ``planner`` ("rlfleet", "seed"), ``senders`` ("all", "one"), ``fanout`` ("auto",
    "node_buffer", "direct") and ``cuda_ipc`` ("auto", "off", "host": the IPC path over host
    memory, a test mode) are placement's `make_sync_plan` options, checked by its
    `check_sync_options`.

    ``wire_dtype`` (e.g. "bfloat16"; None: the trainer's own): what floating weights travel and
    are served as; the trainers cast while packing, once per version, and each rollout worker's
    model is cast to it when its weight buffer is made (bf16 from fp32 halves every sync's bytes).
    ``delta`` ("auto", "off"): broadcast steps send a version as its difference from the last one
    every receiver of the group committed (one more model copy on the trainer's host, in the wire
    dtype); a receiver without that base makes the version go full. Reshard P2P refits
    (``nccl_reshard_refit``) follow it too: each training rank sends each generation rank the
    delta of that rank's own slices (one copy of what it sends on its host), and full to a
    generation rank that does not hold its base.
    """

    type: str | None = None
    buffer_strategy: str = "Double"
    bucket_bytes: int = 64 * 1024 * 1024
    checksums: bool = False
    planner: str = "rlfleet"
    senders: str = "all"
    fanout: str = "auto"
    cuda_ipc: str = "auto"
    wire_dtype: str | None = None
    delta: str = "off"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        strategy = check_strategy(self.buffer_strategy, "weight_buffer.buffer_strategy")
        kind = TYPE_OF_STRATEGY[strategy]
        if self.type is None:
            self.type = kind
        _choice(self.type, BUFFER_TYPES, "weight_buffer.type")
        if self.type != kind:
            raise ValueError(
                f"weight_buffer.type {self.type!r} does not fit buffer_strategy {strategy!r}, "
                f"which builds {kind!r} (leave type unset: it follows from the strategy)"
            )
        if not isinstance(self.checksums, bool):
            raise ValueError(f"weight_buffer.checksums must be a bool, got {self.checksums!r}")
        wire = self.wire_dtype
        if wire is not None and (wire not in DTYPES or not DTYPES[wire].is_floating_point):
            floats = sorted(n for n, d in DTYPES.items() if d.is_floating_point)
            raise ValueError(f"weight_buffer.wire_dtype {wire!r} is not one of {floats}")
        check_delta_mode(self.delta, "weight_buffer.delta")
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 512:
            raise ValueError(f"weight_buffer.bucket_bytes must be an int >= 512, got {self.bucket_bytes!r}")
        opts = (self.buffer_strategy, self.planner, self.senders, self.fanout, self.cuda_ipc)
        check_sync_options(*opts, prefix="weight_buffer.")


@dataclass
class PolicyConfig:
    """The policy group's configuration (the seed's `PolicyConfig` fields, plus deadlines).

    ``max_concurrency`` is the eval actors' Ray concurrency (the seed uses 16 in async mode;
    sync mode needs more than 1 too, so that weights stream in while the actor serves).
    Every blocking step is bounded: ``rpc_timeout_s`` for a control call, ``sync_timeout_s``
    for a whole weight sync (one deadline every step of it shares), ``group_timeout_s`` for
    creating a communication group. ``topology``: overrides for `Topology.from_ray_nodes`
    (NIC and host rates, ...); ``cost_model``: the `CostModel` sync plans are priced with
    (e.g. from `PolicyGroup.calibrate()`; default: placement's documented defaults).

    Async RL: ``max_staleness`` (versions; None = unbounded) is the router's bound: no request
    goes to a rollout worker more than that many versions behind the version the group last
    committed (announced to the router when a sync commits), so every sample comes from weights
    at most that stale. ``on_new_version`` ("forget" or "keep"; router_type "prefix_aware"
    only): whether the router still counts a worker's cached prefixes once it serves a new
    version (``BasePolicy.on_weight_version`` is where the worker clears its engine's cache).
    """

    rollout_mode: str = "sync"
    router_type: str = "simple"
    weight_buffer: WeightBufferConfig = field(default_factory=WeightBufferConfig)
    train_num_gpus: float = 0.0
    eval_num_gpus: float = 0.0
    train_num_cpus: float = 0.0
    eval_num_cpus: float = 0.0
    max_concurrency: int = 16
    eval_max_pending: int = 8
    train_max_pending: int = 1
    rpc_timeout_s: float = 120.0
    sync_timeout_s: float = 300.0
    group_timeout_s: float = 60.0
    drain_timeout_s: float = 60.0
    backend: str = "gloo"
    component_distribution: dict[Any, Any] | None = None
    topology: dict[str, Any] | None = None
    cost_model: CostModel | None = None
    max_staleness: int | None = None
    on_new_version: str = "forget"

    def __post_init__(self) -> None:
        if isinstance(self.weight_buffer, dict):
            self.weight_buffer = WeightBufferConfig(**self.weight_buffer)
        self.validate()

    def validate(self) -> None:
        _choice(self.rollout_mode, ROLLOUT_MODES, "rollout_mode")
        _choice(self.router_type, ROUTER_TYPES, "router_type")
        if not isinstance(self.weight_buffer, WeightBufferConfig):
            raise TypeError(
                f"weight_buffer must be a WeightBufferConfig, got {type(self.weight_buffer).__name__}"
            )
        self.weight_buffer.validate()
        for name in ("train_num_gpus", "eval_num_gpus", "train_num_cpus", "eval_num_cpus"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        for name in ("max_concurrency", "eval_max_pending", "train_max_pending"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name in ("rpc_timeout_s", "sync_timeout_s", "group_timeout_s", "drain_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        _choice(self.backend, ("gloo", "nccl"), "backend")
        if self.topology is not None and not isinstance(self.topology, dict):
            raise ValueError(
                f"topology must be a dict of Topology.from_ray_nodes overrides, got {self.topology!r}"
            )
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise ValueError(f"cost_model must be a rlfleet.placement CostModel, got {self.cost_model!r}")
        self._validate_async()

    def _validate_async(self) -> None:
        bound = self.max_staleness
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
            raise ValueError(
                f"max_staleness must be None (unbounded) or an int >= 0 (versions), got {bound!r}"
            )
        _choice(self.on_new_version, PREFIX_CACHE_ON_NEW_VERSION, "on_new_version")
        if self.on_new_version != "forget" and self.router_type != "prefix_aware":
            raise ValueError(
                f"on_new_version {self.on_new_version!r} applies to router_type 'prefix_aware' (the only "
                f"router that tracks cached prefixes), not {self.router_type!r}"
            )


@dataclass
class TrainConfig:
    """What a trainer needs to set up its optimiser (user policies may read more fields)."""

    lr: float = 1e-3
    seed: int = 0
    batch_size: int = 32
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"TrainConfig.batch_size must be an int >= 1, got {self.batch_size!r}")
