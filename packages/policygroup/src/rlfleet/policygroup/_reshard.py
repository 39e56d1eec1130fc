"""NeMo RL's ``nccl_reshard`` planning on a worker: the plan is rlfleet.placement's, the run weightsync's.

`ReshardWorkerMixin` adds to weightsync's `ReshardCalls` (groups, transfer, refit) what needs
the planner: the parameter specs of each side and ``prepare_nccl_reshard_refit_info``, which
plans with ``rlfleet.placement.plan_reshard`` and hands this rank's program to the calls.
Hooks a policy overrides: `reshard_param_specs`, `reshard_gen_param_specs` (and weightsync's
`reshard_rank`, `reshard_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlfleet.placement import Parallelism, ParamSpec, plan_reshard
from rlfleet.weightsync import CommGroupError, RankProgram, ReshardCalls, dtype_name, transport_state

__all__ = ["ReshardWorkerMixin"]


class ReshardWorkerMixin(ReshardCalls):
    """The ``nccl_reshard`` calls of NeMo RL's policy worker, for `BasePolicy` to inherit."""

    # -- hooks ------------------------------------------------------------------------------
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
