"""From an executor's plain settings to the plan it runs: its processes, its CUDA IPC mode and
the planner's validated plan.

An executor knows each worker's id, role, node, GPU and machine, and its configuration as
strings; these functions turn that into `plan_sync`'s or `seed_sync_plan`'s inputs, so every
executor (and its tests) plans the same way without a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Literal, cast

from rlfleet.placement._errors import SyncPlanError
from rlfleet.placement._public import public
from rlfleet.placement.cost._model import CostModel
from rlfleet.placement.sync._plan import SYNC_STRATEGIES, Role, SyncPlan, SyncProcess
from rlfleet.placement.sync._planner import FANOUTS, SENDERS, plan_sync, seed_sync_plan
from rlfleet.placement.topology._topology import Topology

__all__ = [
    "CUDA_IPC_SETTINGS",
    "PLANNERS",
    "WorkerSite",
    "check_sync_options",
    "cuda_ipc_mode",
    "make_sync_plan",
    "sync_processes",
]

#: The planners `make_sync_plan` chooses between: ours (`plan_sync`) and the seed's round robin.
PLANNERS: tuple[str, ...] = ("rlfleet", "seed")
#: How a trainer may hand weights to same-node workers: CUDA IPC ("auto"), never ("off"), or the
#: IPC step on every same-node worker over host shared memory ("host", a test mode).
CUDA_IPC_SETTINGS: tuple[str, ...] = ("auto", "off", "host")

#: Where a worker runs: (process id, role, node, GPU index or -1 for a CPU process, machine).
WorkerSite = tuple[str, str, str, int, str | None]


@public
def check_sync_options(
    strategy: str,
    planner: str = "rlfleet",
    senders: str = "all",
    fanout: str = "auto",
    cuda_ipc: str = "auto",
    *,
    prefix: str = "",
) -> None:
    """SyncPlanError, naming the setting (`prefix` + its name), for a choice that is unknown or
    that cannot run with `strategy`: an executor's configuration is refused before any plan.

    "Shared" keeps its node buffer: its rollout workers compute with zero-copy views of it, which
    neither IPC slots nor a relay's direct copies give; a relay without a buffer has none to fill.
    """
    for value, valid, name in (
        (strategy, SYNC_STRATEGIES, "strategy"),
        (planner, PLANNERS, "planner"),
        (senders, SENDERS, "senders"),
        (fanout, FANOUTS, "fanout"),
        (cuda_ipc, CUDA_IPC_SETTINGS, "cuda_ipc"),
    ):
        if value not in valid:
            raise SyncPlanError(f"{prefix}{name} {value!r} is unknown; valid: {', '.join(valid)}")
    shared = strategy == "Shared"
    if cuda_ipc == "host" and shared:
        raise SyncPlanError(
            f"{prefix}cuda_ipc 'host' does not run with strategy 'Shared': its rollout workers compute "
            "with zero-copy views of the node buffer, which IPC slots cannot give"
        )
    if fanout == ("direct" if shared else "node_buffer"):
        why = (
            "every rollout worker of a node binds the node's one buffer; one receives for it"
            if shared
            else "a rollout worker that relays copies has no node buffer to fill; use 'direct'"
        )
        raise SyncPlanError(f"{prefix}fanout {fanout!r} does not run with strategy {strategy!r}: {why}")


@public
def sync_processes(workers: Sequence[WorkerSite], strategy: str) -> list[SyncProcess]:
    """Each worker as a `SyncProcess`, in order; with "Sharded" the i-th of a node's n rollout
    workers (in order) keeps share (i, n) of the weights."""
    mates: dict[str, list[str]] = {}
    for pid, role, node, _, _ in workers:
        if role == "rollout":
            mates.setdefault(node, []).append(pid)
    out = []
    for pid, role, node, gpu, machine in workers:
        shard = None
        if role == "rollout" and strategy == "Sharded":
            shard = (mates[node].index(pid), len(mates[node]))
        device = "cpu" if gpu < 0 else f"cuda:{gpu}"
        out.append(SyncProcess(pid, cast(Role, role), node, device, shard, machine))
    return out


@public
def cuda_ipc_mode(setting: str, strategy: str, processes: bool) -> bool | Literal["force"]:
    """`plan_sync`'s ``cuda_ipc`` for a `CUDA_IPC_SETTINGS` entry: True lets GPU workers of a node
    meet by CUDA IPC, "force" every same-node worker ("host"), False none. An IPC channel joins
    two processes (`processes`: the workers are separate processes, Ray actors); "Shared" binds
    its node buffer zero-copy, so it keeps that buffer."""
    if setting not in CUDA_IPC_SETTINGS:
        raise SyncPlanError(f"cuda_ipc must be one of {list(CUDA_IPC_SETTINGS)}, got {setting!r}")
    if setting == "off" or strategy == "Shared":
        return False
    if not processes:
        if setting == "host":
            raise SyncPlanError("cuda_ipc 'host' needs Ray actors: an IPC channel joins two processes")
        return False
    return "force" if setting == "host" else True


@public
def make_sync_plan(
    processes: Sequence[SyncProcess],
    bucket_bytes: Sequence[int],
    strategy: str,
    *,
    planner: str = "rlfleet",
    bucket_tensors: Sequence[int] | None = None,
    layout_digest: str | None = None,
    topology: Topology | None = None,
    cost: CostModel | None = None,
    colocated: bool = False,
    senders: str = "all",
    fanout: str = "auto",
    cuda_ipc: bool | Literal["force"] = False,
) -> SyncPlan:
    """The `planner`'s plan ("rlfleet": `plan_sync`, "seed": `seed_sync_plan`), validated; a plan
    that would hand weights over by CUDA IPC where `cuda_ipc` (from `cuda_ipc_mode`) forbids it
    is refused with a SyncPlanError that says what to change."""
    if planner not in PLANNERS:
        raise SyncPlanError(f"planner must be one of {list(PLANNERS)}, got {planner!r}")
    make: Callable[..., SyncPlan] = partial(seed_sync_plan, colocated=colocated)
    if planner == "rlfleet":
        fan = cast(Literal["auto", "node_buffer", "direct"], fanout)
        make = partial(plan_sync, senders=cast(Literal["all", "one"], senders), fanout=fan, cuda_ipc=cuda_ipc)
    plan = make(
        processes,
        bucket_bytes,
        strategy,
        topology=topology,
        cost=cost,
        layout_digest=layout_digest,
        bucket_tensors=bucket_tensors,
    )
    plan.validate()
    if not cuda_ipc and any(s.transport == "cuda_ipc" for s in plan.steps):
        raise SyncPlanError(
            "the seed's colocated plan hands weights to GPU workers by CUDA IPC, which "
            "weight_buffer.cuda_ipc and these workers do not allow (use Ray actors and cuda_ipc "
            "'auto', or planner 'rlfleet')"
        )
    return plan
