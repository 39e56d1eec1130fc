"""NeMo RL's ``nccl_reshard`` worker calls, run on a worker: groups, the transfer, the refit.

Trainers and rollout workers shard the model differently; instead of broadcasting the whole
model to every rollout (generation) rank, each receives exactly its own shard, point to point,
from data-parallel replicas striped across the training ranks. The plan comes from the host
(``prepare_nccl_reshard_refit_info`` plans with ``rlfleet.placement.plan_reshard``) as this
rank's `RankProgram` and each pipeline stage's training ranks; these calls form the groups
(one per training pipeline stage, gloo on CPU, NCCL on GPU), run the transfer with
`ReshardSender` / `ReshardReceiver` (versioned, atomic, deadline-bounded) and apply it.
``WeightBufferConfig.delta="auto"`` makes each pair send the delta of its own slices against
the version the generation rank holds (its live weights are the base; full when it lacks it).
Hooks a worker overrides: `reshard_rank`, `reshard_state_dict`, `reshard_param_specs`,
`reshard_gen_param_specs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlfleet.placement import Parallelism, ParamSpec, plan_reshard
from rlfleet.policygroup.nemo._refit_calls import DEFAULT_REFIT_TIMEOUT_S, transport_state
from rlfleet.policygroup.worker._host import WorkerHost
from rlfleet.weightsync import (
    CommGroupError,
    Deadline,
    DoubleBuffer,
    MemberGroup,
    PeerGroup,
    RankProgram,
    ReshardReceiver,
    ReshardSender,
    ReshardStats,
    SyncWatch,
    WatchedP2PWire,
    connect_store,
    dtype_name,
    module_part_buffer,
)

__all__ = ["ReshardCalls", "ReshardState"]


@dataclass
class ReshardState:
    """Everything the reshard calls keep in a worker (created on first use: no __init__ needed)."""

    groups: dict[int, Any] = field(default_factory=dict)
    stores: list[Any] = field(default_factory=list)
    pp_size: int = 0
    my_pp_stage: int = -1
    sub_world_size: int = 0
    my_rank_in_group: int = -1
    plan: Any = None  # the host's plan (placement's ReshardPlan), kept for introspection
    program: RankProgram | None = None
    sender: ReshardSender | None = None
    receiver: ReshardReceiver | None = None
    consumer: DoubleBuffer | None = None
    last: ReshardStats | None = None
    kv_scales: dict[str, float] = field(default_factory=dict)
    # the refit's deadline: a watchdog that stand_down_refit_watchdog lifts (the wire has none)
    watch: SyncWatch = field(default_factory=lambda: SyncWatch("nccl_reshard"))


class ReshardCalls(WorkerHost):
    """NeMo RL's ``nccl_reshard`` calls (groups, planning, transfer and refit), for a worker class
    to inherit (`BasePolicy` does)."""

    # -- hooks ------------------------------------------------------------------------------
    def reshard_rank(self) -> int:
        """This worker's rank among the training (or generation) workers."""
        return int(self.index)

    def reshard_state_dict(self) -> Mapping[str, torch.Tensor]:
        """The local shards a training worker sends, by training parameter name."""
        return {k: v.detach() for k, v in self.model.state_dict(keep_vars=True).items()}

    # -- state -------------------------------------------------------------------------------
    def _reshard_state(self) -> ReshardState:
        state: ReshardState | None = self.__dict__.get("_reshard")
        if state is None:
            state = ReshardState()
            self.__dict__["_reshard"] = state
        return state

    def _reshard_side(self) -> str:
        return "train" if str(getattr(self.role, "value", self.role)) == "train" else "gen"

    # -- the seed's calls -----------------------------------------------------------------------
    def init_nccl_reshard_comm_group(
        self,
        pp_ips: list[str],
        pp_ports: list[int],
        pp_size: int,
        my_pp_stage: int,
        sub_world_size: int,
        my_rank_in_group: int,
    ) -> None:
        """Bootstrap this worker's nccl_reshard group(s): one per training pipeline stage.

        A training worker joins ``pp_ips[my_pp_stage]:pp_ports[my_pp_stage]``; a generation
        worker joins every stage's group. Bounded by ``config.group_timeout_s``: a member that
        does not show up is named.
        """
        if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
            raise ValueError(f"pp_size must be a positive int, got {pp_size!r}")
        if len(pp_ips) != pp_size or len(pp_ports) != pp_size:
            raise ValueError(f"need one ip and one port per stage: pp_size={pp_size}, {pp_ips}, {pp_ports}")
        if not 0 <= my_rank_in_group < sub_world_size:
            raise ValueError(f"my_rank_in_group {my_rank_in_group} outside sub_world_size {sub_world_size}")
        train = self._reshard_side() == "train"
        if train and not 0 <= my_pp_stage < pp_size:
            raise ValueError(f"my_pp_stage {my_pp_stage} outside 0..{pp_size - 1}")
        state = self._reshard_state()
        self.destroy_nccl_reshard_comm_group()
        timeout_s = self.config.group_timeout_s
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        for stage in [my_pp_stage] if train else list(range(pp_size)):
            what = f"nccl_reshard group of stage {stage} ({pp_ips[stage]}:{pp_ports[stage]})"
            try:  # the group's timeout (NCCL's too) is the group timeout
                store = connect_store(
                    pp_ips[stage], int(pp_ports[stage]), my_rank_in_group, sub_world_size, timeout_s
                )
                group = MemberGroup.create(
                    store, f"reshard/{stage}", my_rank_in_group, sub_world_size, timeout_s, backend
                )
            except Exception as exc:
                raise CommGroupError(f"{what}: {exc}", tuple(getattr(exc, "missing", ()))) from exc
            state.groups[stage] = group.process_group
            state.stores.append(store)
        state.pp_size = pp_size
        state.my_pp_stage = my_pp_stage if train else -1
        state.sub_world_size = sub_world_size
        state.my_rank_in_group = my_rank_in_group
        if train:
            self.pp_comm_group = state.groups[my_pp_stage]

    def destroy_nccl_reshard_comm_group(self) -> None:
        """Drop the reshard groups and everything built on them."""
        state = self._reshard_state()
        state.groups.clear()
        state.stores.clear()
        state.sender = state.receiver = None
        state.consumer = None

    def _prepare_reshard(
        self, plan: Any, program: RankProgram, stage_ranks: Mapping[int, Sequence[int]], gen_world_size: int
    ) -> int:
        """Get ready to run this rank's part of `plan`: `program` is its `RankProgram`,
        `stage_ranks` the training ranks of each pipeline stage; returns the bucket size."""
        state = self._reshard_state()
        side, rank = self._reshard_side(), self.reshard_rank()
        peer_groups = []
        for stage, group in sorted(state.groups.items()):
            ranks = list(stage_ranks[stage])
            if len(ranks) + gen_world_size != state.sub_world_size:
                raise ValueError(
                    f"stage {stage}: {len(ranks)} training + {gen_world_size} generation ranks, "
                    f"but sub_world_size is {state.sub_world_size}"
                )
            if side == "train" and rank not in ranks:
                raise ValueError(f"training rank {rank} is not on pipeline stage {stage}")
            expected = ranks.index(rank) if side == "train" else len(ranks) + rank
            if expected != state.my_rank_in_group:
                raise ValueError(
                    f"{side} rank {rank} should be rank {expected} of stage {stage}'s group, "
                    f"joined as {state.my_rank_in_group}"
                )
            wire = WatchedP2PWire(group, state.watch)
            peer_groups.append(PeerGroup.stage(wire, ranks, gen_world_size, key=stage))
        bucket_bytes = min(self.config.weight_buffer.bucket_bytes, 64 * 1024 * 1024)
        state.plan, state.program = plan, program
        state.sender = state.receiver = None
        state.consumer = None
        if side == "train":
            delta = getattr(self.config.weight_buffer, "delta", "off")
            state.sender = ReshardSender(program, peer_groups, bucket_bytes=bucket_bytes, delta=delta)
        else:
            state.receiver = ReshardReceiver(program, peer_groups, bucket_bytes=bucket_bytes)
            state.consumer = self._reshard_consumer(program)
        return bucket_bytes

    def _reshard_consumer(self, program: RankProgram) -> DoubleBuffer:
        """A generation worker's consumer over its part of the model, resumed at the worker's
        version: a DoubleBuffer, whose live weights are the base a delta is rebuilt on."""
        version, who = self._weights.version, f"generation worker {self.index}"
        layout, drain = program.layout(), self.config.drain_timeout_s
        return module_part_buffer(
            self.model, layout, version=version, serving_lock=self._serve, commit_timeout_s=drain, who=who
        )

    def nccl_reshard_refit(
        self,
        kv_scales: dict[str, float] | None = None,
        refit_timeout_s: float | None = None,
        *,
        version: int | None = None,
    ) -> None:
        """Move one version from the training workers to the generation workers.

        Raises a WeightSyncError subclass naming what failed (and nothing is applied anywhere)
        if any worker fails, a peer dies, or ``refit_timeout_s`` passes. That deadline is a
        watchdog: once `stand_down_refit_watchdog()` stands it down the refit ends only by data
        or by a lost peer.
        """
        state = self._reshard_state()
        timeout_s = DEFAULT_REFIT_TIMEOUT_S if refit_timeout_s is None else refit_timeout_s
        with state.watch.guard(timeout_s, "nccl_reshard_refit") as deadline:
            self._reshard_refit(state, kv_scales, version, deadline)
        refit = transport_state(self, "nccl_reshard")
        refit.update(version=self._weights.version, last=self.get_reshard_stats())

    def _reshard_refit(
        self,
        state: ReshardState,
        kv_scales: dict[str, float] | None,
        version: int | None,
        deadline: Deadline,
    ) -> None:
        if state.sender is not None:
            v = self._weights.version + 1 if version is None else int(version)
            extras = {"kv_scales": {str(k): float(x) for k, x in kv_scales.items()}} if kv_scales else {}
            state.last = state.sender.send(self.reshard_state_dict(), v, deadline, extras)
            self._weights.version = v
            return
        if state.receiver is None or state.consumer is None or state.program is None:
            raise CommGroupError("nccl_reshard_refit: prepare_nccl_reshard_refit_info() must come first")
        if state.consumer.version != self._weights.version:
            # weights set since the last refit (a checkpoint, a reset): not the base the consumer
            # would offer, so it resumes at the worker's version (a delta against it, or full)
            state.consumer = self._reshard_consumer(state.program)
        stats = state.receiver.receive(state.consumer, deadline)
        state.last = stats
        self._weights.version = stats.version
        scales = dict(kv_scales or {})
        sent = stats.extras.get("kv_scales")
        if isinstance(sent, dict):
            scales.update({str(k): float(x) for k, x in sent.items()})
        if scales:
            self._apply_kv_scales(scales)

    def _apply_kv_scales(self, scales: Mapping[str, float]) -> None:
        """Fill matching one-element buffers or parameters (e.g. ``...k_scale``); keep every scale."""
        state = self._reshard_state()
        state.kv_scales.update(scales)
        live = dict(self.model.state_dict(keep_vars=True))
        with torch.no_grad():
            for name, value in scales.items():
                tensor = live.get(name)
                if tensor is not None and tensor.numel() == 1:
                    tensor.fill_(value)

    # -- introspection ----------------------------------------------------------------------------
    @property
    def reshard_kv_scales(self) -> dict[str, float]:
        return dict(self._reshard_state().kv_scales)

    def get_reshard_stats(self) -> dict[str, Any] | None:
        """What the last refit moved on this worker (JSON-safe), or None.

        ``bytes`` is what moved and ``full_bytes`` what the same messages weigh full; with
        ``WeightBufferConfig(delta="auto")`` ``base`` is the version the deltas were against
        (None: all full) and ``delta_peers`` the peers' ranks whose messages were deltas.
        """
        last = self._reshard_state().last
        if last is None:
            return None
        return {
            "version": last.version,
            "messages": last.messages,
            "bytes": last.nbytes,
            "full_bytes": last.full_bytes,
            "seconds": last.seconds,
            "base": last.base,
            "delta_peers": [int(r) for r in last.delta_peers],
        }

    # -- planning hooks and call (rlfleet.placement.plan_reshard) ------------------------------
    def reshard_param_specs(self) -> Sequence[ParamSpec | Mapping[str, Any]]:
        """The model's parameters as the training side shards them (full shapes; same on every worker).

        The default reads this worker's model as unsharded and replicated on the first stage;
        override it for tensor- or pipeline-parallel models.
        """
        return [
            ParamSpec(name, tuple(t.shape), dtype_name(t.dtype))
            for name, t in self.model.state_dict(keep_vars=True).items()
        ]

    def reshard_gen_param_specs(self) -> Sequence[ParamSpec | Mapping[str, Any]] | None:
        """The generation side's parameters when they differ (renamed or fused); None: the same."""
        return None

    def prepare_nccl_reshard_refit_info(
        self,
        train_parallelism: dict[str, int],
        gen_parallelism: dict[str, int],
        train_world_size: int,
        gen_world_size: int,
    ) -> dict[str, Any]:
        """Plan the reshard and get this worker ready to run its part; returns a JSON-safe summary.

        Parallelism dicts take ``tp``/``pp``/``dp`` or Megatron's / NeMo's names
        (``tensor_model_parallel_size``, ...); ``dp`` follows from the world size if omitted.
        """
        state = self._reshard_state()
        if not state.groups:
            raise CommGroupError(
                "prepare_nccl_reshard_refit_info: init_nccl_reshard_comm_group() must come first"
            )
        train = Parallelism.coerce(train_parallelism, train_world_size)
        gen = Parallelism.coerce(gen_parallelism, gen_world_size)
        if train.pp != state.pp_size:
            raise ValueError(
                f"training pp={train.pp}, but the reshard groups were made for pp_size={state.pp_size}"
            )
        plan = plan_reshard(self.reshard_param_specs(), train, gen, gen_params=self.reshard_gen_param_specs())
        side, rank = self._reshard_side(), self.reshard_rank()
        program = RankProgram.from_dict(plan.rank_program(side, rank))
        stage_ranks = {stage: plan.train.stage_ranks(stage) for stage in state.groups}
        bucket_bytes = self._prepare_reshard(plan, program, stage_ranks, gen.world_size)
        summary = plan.summary()
        info = {
            "digest": plan.digest,
            "role": side,
            "rank": rank,
            "train": plan.train.to_dict(),
            "gen": plan.gen.to_dict(),
            "moves": len(plan.moves),
            "transfers": len(program.transfers),
            "bytes": program.nbytes,
            "own_shard_bytes": summary["own_shard_bytes"].get(rank) if side == "gen" else None,
            "peers": [r for _, r in program.peers()],
            "tensors": len(program.tensors),
        }
        groups = {str(k): {"rank": int(g.rank()), "size": int(g.size())} for k, g in state.groups.items()}
        transport_state(self, "nccl_reshard").update(info, groups=groups, bucket_bytes=bucket_bytes)
        return info
