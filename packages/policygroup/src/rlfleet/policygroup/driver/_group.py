"""`PolicyGroup`: the seed's public API over local policy objects or Ray actor handles.

A facade over `_calls` (roster, bounded calls, failure classification), `_rollout` (routing and
dispatch), the `sync` folder (the `SyncPlan` placement makes, prepared and run) and
`_membership` (role changes, dead workers); it holds the lock that orders membership, plans and
versions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any, Literal, overload

import ray

from rlfleet.placement import CostModel, Placement, SyncPlan, SyncReport, SyncStep
from rlfleet.policygroup._batched import BatchedData
from rlfleet.policygroup._config import PolicyConfig, TrainConfig
from rlfleet.policygroup._policy import SNAPSHOTS_ASKED, PolicyRole
from rlfleet.policygroup.driver._calls import Calls, Policy, Roster, finished
from rlfleet.policygroup.driver._membership import Membership
from rlfleet.policygroup.driver._rollout import Rollouts
from rlfleet.policygroup.driver._submitter import TaskSubmitter, is_remote
from rlfleet.policygroup.sync._background import BackgroundSyncs
from rlfleet.policygroup.sync._plan import Processes
from rlfleet.policygroup.sync._weight_sync import SyncOutcome, WeightSync
from rlfleet.policygroup.worker import ParallelMode
from rlfleet.routing import Router
from rlfleet.weightsync import PublishHandle, compare_fingerprints

logger = logging.getLogger(__name__)


class PolicyGroup:
    """Trainers and rollout workers: placement, groups, weight sync, routing, roles.

    The seed's public calls and arguments. Weight syncs are versioned and, with "Double" /
    "Shared", applied as a rolling update (each rollout worker drained only for its own swap);
    a dead rollout worker is dropped from routing and from the sync's steps; every wait is bounded.
    """

    def __init__(
        self,
        train_policy_list: list[Policy],
        eval_policy_list: list[Policy],
        config: PolicyConfig,
        *,
        placement: Placement | None = None,
        owned_actors: Sequence[Any] = (),
        placement_groups: Sequence[Any] = (),
    ) -> None:
        """`placement`: the plan the workers were placed by; `owned_actors` and `placement_groups`:
        what `build_policy_group` created for this group, released by `shutdown`."""
        config.validate()
        self.config, self.placement = config, placement
        self.rollout_mode, self.router_type = config.rollout_mode, config.router_type
        self._roster = Roster(train_policy_list, eval_policy_list)
        self._eval_task_submitter = TaskSubmitter(config.eval_max_pending, config.rpc_timeout_s)
        self._train_task_submitter = TaskSubmitter(config.train_max_pending, config.rpc_timeout_s)
        self._uid = uuid.uuid4().hex[:10]  # names this group's node buffers
        self._lock = threading.RLock()  # membership, plans and versions (never held while serving)
        self._calls = Calls(self._roster, config.rpc_timeout_s, self.check_liveness)
        self._rollouts = Rollouts(self._roster, config, self._eval_task_submitter)
        self._processes = Processes(self._roster, self._calls)
        self._sync = WeightSync(self._calls, self._rollouts, self._processes, config, self._uid)
        submitters = {
            PolicyRole.TRAIN: self._train_task_submitter,
            PolicyRole.EVAL: self._eval_task_submitter,
        }
        self._members = Membership(
            self._calls, self._rollouts, self._sync, submitters, self._lock, self._rebuild
        )
        self._sync.members = self._members  # drops dead rollout workers during a sync
        self._background = BackgroundSyncs(self._sync, self._calls, self._lock, self._sync_version)
        self._owned_actors, self._placement_groups = list(owned_actors), list(placement_groups)
        logger.info("[PolicyGroup] Using router: %s", type(self.router).__name__)

    # ================================================================== the seed's attributes
    @property
    def policy_list(self) -> dict[PolicyRole, list[Policy]]:
        return self._roster.policy_list

    @property
    def eval_list(self) -> list[Policy]:
        return self._roster.eval_list

    @property
    def train_list(self) -> list[Policy]:
        return self._roster.train_list

    @property
    def router(self) -> Router[Any]:
        return self._rollouts.router

    @property
    def placement_info(self) -> dict[Any, dict[str, list[Policy]]]:
        return self._processes.placement_info

    @property
    def transfer_info(self) -> dict[Any, list[dict[str, Any]]]:
        """The seed's shape of the sync plan (a view derived from `sync_plan`)."""
        plan = self.sync_plan
        return {} if plan is None else plan.transfer_info(self._processes.by_pid())

    @property
    def router_map(self) -> dict[Any, list[Any]]:
        """The seed's ``router_map``: each trainer node -> the nodes its version reaches (a view
        derived from `sync_plan`, the plan that runs)."""
        plan = self.sync_plan
        return {} if plan is None else dict(plan.router_map())

    @property
    def sync_plan(self) -> SyncPlan | None:
        """The `SyncPlan` the next sync runs (rlfleet.placement's; re-made when the group changes)."""
        with self._lock:
            return self._sync.plan if self._sync.plan is not None else self._sync.replan()

    @property
    def last_sync_report(self) -> SyncReport | None:
        """What the last sync measured, step by step, next to the plan's prediction."""
        return self._sync.report

    @property
    def buffer_prefix(self) -> str:
        """The /dev/shm name prefix of this group's node buffers (what a leak check looks for)."""
        return f"rlfleet-{self._uid}"

    def process_id(self, policy: Policy) -> str:
        """The id a worker has in sync plans ("t0", "r3")."""
        return self._processes.pid(policy)

    def policy_of(self, process_id: str) -> Policy:
        """The worker a sync plan's process id names (KeyError if none of this group's)."""
        return self._processes.by_pid()[process_id]

    def broadcast_group(self, step: SyncStep) -> tuple[str, int]:
        """(group id, the sender's world rank) of the communication group a broadcast step runs in."""
        members = (step.src, *step.dst)
        return self._sync.wiring.groups[members]

    @property
    def shared_weight_buffer_map(self) -> dict[Any, dict[str, Any]]:
        return self._sync.node_buffers

    @property
    def weight_buffer_strategy(self) -> str | None:
        return self._sync.strategy

    @property
    def weight_version(self) -> int:
        """The version of the last completed sync (0 before the first)."""
        return self._sync.version

    @property
    def next_weight_version(self) -> int:
        """The version the next sync will commit (a trainer that exports its weights itself
        writes them under this number first)."""
        return self._sync.next_version()

    @property
    def last_sync(self) -> SyncOutcome | None:
        """What the last `send_weights` did (version, steps, seconds, workers dropped)."""
        return self._sync.last

    def node_of(self, policy: Policy) -> Any:
        """The node id a policy runs on ("local" for local objects)."""
        return self._processes.node(policy)

    # ================================================================== init
    def init(self, train_config: TrainConfig, env_meta: Any = None, eval_config: Any = None) -> None:
        self.init_eval(eval_config, env_meta)
        self.init_train(train_config, env_meta)

    def init_eval(self, eval_config: Any = None, env_meta: Any = None) -> list[Any]:
        return self._calls.call_all(self.eval_list, "init_eval", eval_config, env_meta)

    def init_train(self, train_config: Any, env_meta: Any = None) -> list[Any]:
        return self._calls.call_all(self.train_list, "init_train", train_config, env_meta)

    def init_placement_info(self, is_colocated: bool = False) -> None:
        """Find each worker's node and device, and have rlfleet.placement plan the sync (`sync_plan`)."""
        with self._lock:
            self._processes.colocated = is_colocated
            self._processes.locate(self.train_list + self.eval_list)
            if self.train_list:
                self._sync.layout = self._sync.trainer_layout()
            self._sync.replan()
            nodes = {str(k)[:12]: {r: len(v) for r, v in e.items()} for k, e in self.placement_info.items()}
            logger.info("placement_info: %s", nodes)  # as the seed logs it

    def init_weight_buffer(self) -> None:
        """Prepare every rollout worker to receive weights with the configured strategy."""
        with self._lock:
            self._sync.prepare_buffers()

    def init_comm_group(self, backend: str = "nccl", is_colocated: bool = False) -> None:
        """Create the world group, intra-node groups, one group per broadcast and the train
        data-parallel group on remote actors, bounded (a no-op for local objects, as the seed)."""
        with self._lock:
            everyone = self.train_list + self.eval_list
            if not everyone or not all(is_remote(p) for p in everyone):
                return
            if backend == "nccl" and self.config.train_num_gpus == 0 and self.config.eval_num_gpus == 0:
                backend = "gloo"  # no GPUs: the seed's default backend cannot run
            self._sync.form_groups(backend)

    # ================================================================== rollouts
    def rollout_batch(self, batched_env_ret: BatchedData[Any]) -> BatchedData[Any]:
        """Route each request (env id as key), one task per rollout worker per batch; returns
        BatchedData(ids, responses): ObjectRefs for actors, values for local policies; its
        ``versions()`` say which weight version produced each response (ObjectRefs / ints)."""
        self._members.purge_dead()
        return self._rollouts.rollout_batch(batched_env_ret)

    async def rollout_batch_async(
        self, batched_env_ret: BatchedData[Any], timeout: float | None = None
    ) -> BatchedData[Any]:
        """`rollout_batch` for asyncio: routing waits (up to `timeout`, default
        ``rpc_timeout_s``) for a worker within ``max_staleness`` without blocking the loop;
        returns BatchedData(ids, responses, versions) with values and versions resolved."""
        self._members.purge_dead()
        return await self._rollouts.rollout_batch_async(
            batched_env_ret, self.config.rpc_timeout_s if timeout is None else timeout
        )

    def postprocess(
        self,
        batched_env_ret: BatchedData[Any] | None = None,
        batched_policy_resp: BatchedData[Any] | None = None,
    ) -> BatchedData[Any]:
        """Submit `_postprocess(env_ret, policy_resp)` per env id to a routed rollout worker."""
        given = [b for b in (batched_env_ret, batched_policy_resp) if b is not None]
        if not given:
            raise ValueError("postprocess needs batched_env_ret or batched_policy_resp")
        return self._rollouts.postprocess(given[0].ids(), [b.values() for b in given])

    def wait_idle(self, timeout: float = 60.0) -> int:
        """Wait until no routed request is in flight (completion callbacks ran); returns what is left."""
        return self._rollouts.wait_idle(timeout)

    # ================================================================== weight sync
    def send_weights(self) -> SyncReport | None:
        """Move the trainers' weights to every rollout worker as the next version (staged);
        returns what it measured (None when there is no rollout worker)."""
        self._background.settle(self.config.sync_timeout_s)
        with self._lock:
            self._sync.last = self._sync.send(self._sync.next_version())
            return self._sync.last.report

    def notify_update_weights(self) -> None:
        """Apply the staged version as a rolling update: drain one rollout worker, swap, undrain."""
        with self._lock:
            self._sync.apply()

    @overload
    def sync_weights(self, block: Literal[True] = ...) -> SyncReport | None: ...
    @overload
    def sync_weights(self, block: Literal[False]) -> PublishHandle[SyncReport | None]: ...
    def sync_weights(self, block: bool = True) -> SyncReport | PublishHandle[SyncReport | None] | None:
        """Send the trainers' weights as the next version and apply it on every rollout worker;
        returns its `SyncReport` (the steps, and the whole sync: ``wall_seconds`` with its
        ``wall_phases`` and ``predicted_wall_seconds``; ``serving_stall_seconds``); None when
        there is no rollout worker.

        ``block=False`` (async RL): returns a handle at once, having asked each sending trainer
        for a snapshot of the version (its next `train` waits for it before the optimizer step:
        forward and backward overlap the copy); the steps and the rolling apply run in the
        background. ``handle.snapshot_done()`` waits for the snapshots; ``handle.result()`` is
        the report.
        A version still waiting when a newer one is snapshotted is skipped (the newer report's
        ``skipped_versions``); a failure nobody collected is raised by the next sync call. Call
        it between training steps, not during one.
        """
        if not block:
            return self._background.submit()
        self._background.settle(self.config.sync_timeout_s)
        with self._lock:
            return self._sync_version(self._sync.next_version())

    def _sync_version(self, version: int) -> SyncReport | None:
        with self._lock:
            self._sync.last = self._sync.send(version)
            sent = self._sync.last.report
            self.notify_update_weights()
            if sent is None or self._sync.last is None:
                return sent
            self._sync.last = dataclasses.replace(self._sync.last, report=self._sync.report)
            return self._sync.report

    def calibrate(self, syncs: int = 3, extra: Sequence[tuple[SyncReport, SyncPlan]] = ()) -> CostModel:
        """Measure the cost model's terms on this cluster and fit them to `syncs` real syncs of
        this group, plus `extra` (report, plan) pairs measured on the same cluster (syncs of other
        plans: one calibration for every shape). The group keeps its configured model; pass the
        result as ``PolicyConfig.cost_model`` to price plans with it."""
        from rlfleet.policygroup.driver._calibrate import calibrate

        self._background.settle(self.config.sync_timeout_s)
        with self._lock:
            return calibrate(self, syncs, extra)

    def wait_for_eval_weight_update(self, timeout: float = 60.0) -> bool:
        """Block (up to `timeout`) until every rollout worker has applied what it received."""
        calls = [(p, self._calls.invoke(p, "wait_for_weight_update_done", timeout)) for p in self.eval_list]
        results = self._calls.gather(calls, timeout + 10.0, "wait_for_eval_weight_update")
        for i, ((p, _), (value, err)) in enumerate(zip(calls, results, strict=True)):
            if err is not None or not value:
                msg = "[WeightConsistency] rollout worker %d (%s) weight update not done: %s"
                logger.warning(msg, i, self._roster.name(p), err or "timed out")
        return all(err is None and value for value, err in results)

    def eval_weight_versions(self) -> list[int]:
        """The weight version each rollout worker serves, in eval_list order."""
        return [int(v) for v in self._calls.call_all(self.eval_list, "get_weight_version")]

    def verify_eval_weight_consistency(self, rtol: float = 1e-3) -> bool:
        """Seed check: per-parameter L2 norms of each rollout worker against trainer 0."""
        if self.weight_buffer_strategy not in (None, "None"):
            self.wait_for_eval_weight_update()
        ref: dict[str, float] = self._calls.call_all(self.train_list[:1], "get_param_fingerprint")[0]
        fingerprints = self._calls.call_all(self.eval_list, "get_param_fingerprint")
        bad = {
            i: found for i, fp in enumerate(fingerprints) if (found := compare_fingerprints(ref, fp, rtol))
        }
        for i, found in bad.items():
            msg = "[WeightConsistency] rollout worker %d has %d mismatched parameter(s): %s"
            logger.warning(msg, i, len(found), "; ".join(found[:10]))
        return not bad

    def verify_eval_weight_checksums(self) -> bool:
        """Exact check: every rollout worker holds byte-identical weights to trainer 0."""
        ref = self._calls.call_all(self.train_list[:1], "get_weight_checksum")[0]
        sums = self._calls.call_all(self.eval_list, "get_weight_checksum")
        bad = [i for i, s in enumerate(sums) if s != ref]
        if bad:
            logger.warning("[WeightConsistency] rollout workers %s differ from trainer 0", bad)
        return not bad

    # ================================================================== training
    def reset_training_state(
        self, train_config: TrainConfig, env_meta: Any = None, seed: int | None = None
    ) -> None:
        self._calls.call_all(self.train_list, "reset_training_state", train_config, env_meta, seed)
        self._calls.call_all(self.train_list, "dist_barrier", ParallelMode.TRAIN_DATA_PARALLEL.value)

    def update_dataset(self, sample_data: list[Any]) -> list[Any]:
        if len(sample_data) != len(self.train_list):
            raise ValueError(f"update_dataset: {len(sample_data)} shards for {len(self.train_list)} trainers")
        submit = self._train_task_submitter.submit
        return [submit(p.update_dataset, d) for p, d in zip(self.train_list, sample_data, strict=True)]

    def train(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        submit = self._train_task_submitter.submit
        calls = []
        for p in self.train_list:  # a trainer asked for snapshots updates only once it took them
            asked = self._background.asked(p)
            extra: dict[str, Any] = {} if asked is None else {SNAPSHOTS_ASKED: asked}
            calls.append((p, finished(submit(p.train, *args, **kwargs, **extra))))
        results = self._calls.gather(calls, self.config.rpc_timeout_s, "train")
        self._calls.raise_failures(self.train_list, results, "train")
        info: dict[str, float] = results[0][0]
        return info

    def save_checkpoint(self, path: str) -> None:
        self._calls.call_all(self.train_list[:1], "save_checkpoint", path)

    def print_timing_summary(self, reset: bool = False) -> None:
        self._calls.call_all(self.train_list + self.eval_list, "print_timing_summary", reset)

    def offload_eval_model(self) -> None:
        self._calls.call_all(self.eval_list, "offload_model")

    def reload_eval_model(self) -> None:
        self._calls.call_all(self.eval_list, "reload_model")

    def offload_model_optimizer(self) -> None:
        self._calls.call_all(self.train_list, "offload_optimizer")

    def offload_model_param_and_grad(self, offload_grad: bool = True, offload_optimizer: bool = True) -> None:
        self._calls.call_all(self.train_list, "offload_model_param_and_grad", offload_grad=offload_grad)
        if offload_optimizer:
            self._calls.call_all(self.train_list, "offload_optimizer")

    def reload_model_param_and_grad(self, load_grad: bool = True, load_optimizer: bool = True) -> None:
        self._calls.call_all(self.train_list, "reload_model_param_and_grad", load_grad=load_grad)
        if load_optimizer:
            self._calls.call_all(self.train_list, "reload_optimizer")

    # ================================================================== membership and faults
    def push(self, policy_worker: Policy, role: PolicyRole) -> None:
        """Add a worker to a role (call the init_* steps again to connect it)."""
        self._members.push(policy_worker, role)

    def pop(self, role: PolicyRole) -> Policy:
        """Take the role's last worker out (re-planned exactly as after a death; see `remove`)."""
        return self._members.pop(role)

    def remove(self, policy: Policy, why: str = "removed") -> None:
        """Take a rollout worker out of routing and the sync plan, as if it had died (for a worker
        the caller knows is unfit, e.g. restarted with its initial weights); it is never written
        to again, and `push` plus the init_* calls bring it back."""
        if not any(p is policy for p in self.eval_list):
            raise ValueError(f"remove: {self._roster.name(policy)} is not a rollout worker of this group")
        self._members.drop(policy, why)

    def convert_train_to_eval(self, num: int) -> None:
        """Turn the last `num` trainers into rollout workers (at least one trainer stays)."""
        with self._lock:
            self._members.train_to_eval(num)

    def convert_eval_to_train(self, num: int) -> None:
        """Turn the last `num` rollout workers into trainers (at least one rollout worker stays)."""
        with self._lock:
            self._members.eval_to_train(num)

    def _rebuild(self) -> None:
        """After a role change: placement, buffers, groups rebuilt, then weights made consistent."""
        self._calls.call_all(self.train_list + self.eval_list, "release_weight_buffers")
        self.init_placement_info(self._processes.colocated)
        self.init_weight_buffer()
        self.init_comm_group(self._sync.wiring.backend, self._processes.colocated)
        self._sync_version(self._sync.next_version())  # under the lock: not behind a background sync

    def check_liveness(self, timeout: float = 10.0) -> list[str]:
        """Ping every worker; drop dead rollout workers (returned by name); a dead trainer raises."""
        return self._members.check_liveness(timeout)

    # ================================================================== shutdown
    def shutdown(self) -> None:
        """Release node buffers on every worker; kill the actors and placement groups this group owns
        (background syncs first finish, within ``sync_timeout_s``)."""
        self._background.quiesce(self.config.sync_timeout_s)
        everyone = self.train_list + self.eval_list
        self._calls.gather(
            [(p, self._calls.invoke(p, "release_weight_buffers")) for p in everyone], 30, "shutdown"
        )
        for actor in self._owned_actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        for pg in self._placement_groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
        self._owned_actors, self._placement_groups = [], []
        self._rollouts.forget_inflight()
