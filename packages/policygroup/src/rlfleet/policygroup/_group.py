"""`PolicyGroup`: the seed's public API over local policy objects or Ray actor handles.

Composition only: placement and transfer info come from rlfleet.placement, routing decisions
from rlfleet.routing, byte layout and integrity checks from rlfleet.weightsync; this module
sequences calls on the workers, bounds every wait, and keeps the plans in step when workers
die or change roles.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from rlfleet.placement import (
    CommGroup,
    CommGroupPlan,
    build_transfer_info_for_colocated,
    build_transfer_info_for_disaggregated,
    plan_comm_groups,
)
from rlfleet.policygroup import _comm
from rlfleet.policygroup._batched import BatchedData
from rlfleet.policygroup._config import PolicyConfig, TrainConfig
from rlfleet.policygroup._errors import (
    PolicyGroupError,
    TaskTimeoutError,
    TrainWorkerDiedError,
    WorkerDiedError,
)
from rlfleet.policygroup._submitter import TaskSubmitter, actor_key, is_remote, resolve_object
from rlfleet.policygroup._worker import BasePolicy, ParallelMode, PolicyRole
from rlfleet.routing import NodeAffinityRouter, Router, UnknownWorkerError, create_router
from rlfleet.weightsync import LayoutMismatchError, compare_fingerprints

logger = logging.getLogger(__name__)

Policy = Any  # BasePolicy | ray.actor.ActorHandle


def _is_dead(exc: BaseException | None) -> bool:
    if exc is None:
        return False
    if isinstance(getattr(exc, "cause", None), WorkerDiedError):  # restarted: the old process died
        return True
    kinds: tuple[type[BaseException], ...] = (ray.exceptions.RayActorError,)
    unavailable = getattr(ray.exceptions, "ActorUnavailableError", None)
    if unavailable is not None:
        kinds += (unavailable,)
    return isinstance(exc, kinds)


def _died_itself(policy: Any, exc: BaseException | None) -> bool:
    """A dead-actor error about `policy` itself, not one a task inherited from a dead dependency.

    A reader's `stage_from_segment` takes its node writer's call as an argument: if the writer
    died, Ray fails the reader's task with the writer's RayActorError, and the reader is alive.
    """
    if not _is_dead(exc):
        return False
    dead = getattr(exc, "actor_id", None) or getattr(exc, "_actor_id", None)  # RayTaskError: _actor_id
    mine = getattr(policy, "_actor_id", None)
    if dead is None or mine is None:
        return True
    return bool((dead if isinstance(dead, str) else dead.hex()) == mine.hex())


def _vagueness(exc: BaseException) -> int:
    """0 for a failure that names what is wrong (a layout error naming the parameter), else 1.

    A sender only learns that a receiver "has a different layout"; the receiver names the
    parameter, so its error is the one worth raising.
    """
    cause = _cause(exc)
    return 0 if isinstance(cause, LayoutMismatchError) and cause.parameter else 1


def _cause(exc: BaseException) -> BaseException:
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


class _Local:
    """The outcome of a call on a local policy object, shaped like a finished remote call."""

    __slots__ = ("error", "value")

    def __init__(self, value: Any, error: BaseException | None) -> None:
        self.value = value
        self.error = error


@dataclass
class _Cross:
    """A cross-node transfer item: one broadcast in its own weight-transfer group."""

    sender: Policy
    receivers: list[Policy]
    node: Hashable
    group_id: str | None = None
    src_rank: int | None = None


@dataclass
class _SyncPlan:
    writers: dict[Hashable, Policy] = field(default_factory=dict)
    readers: dict[Hashable, list[Policy]] = field(default_factory=lambda: defaultdict(list))
    cross: list[_Cross] = field(default_factory=list)


class PolicyGroup:
    """Manager of train and eval policies: placement, groups, weight sync, routing, roles.

    Same public calls and arguments as the seed's `PolicyGroup`. Differences that matter:
    weight syncs are versioned and, with "Double"/"Shared", applied as a rolling update (each
    eval policy drained only for its own swap); rollouts are routed with locally kept in-flight
    counts (released on completion, no per-batch RPC to every worker) and dispatched as one
    task per worker per batch; a dead eval policy is dropped from routing and from the
    transfer plan; every wait is bounded.
    """

    def __init__(
        self,
        train_policy_list: list[Policy],
        eval_policy_list: list[Policy],
        config: PolicyConfig,
    ) -> None:
        config.validate()
        self.config = config
        self.policy_list: dict[PolicyRole, list[Policy]] = {
            PolicyRole.TRAIN: list(train_policy_list),
            PolicyRole.EVAL: list(eval_policy_list),
        }
        self.rollout_mode = config.rollout_mode
        self.placement_info: dict[Any, dict[str, list[Policy]]] = {}
        self.weight_buffer_strategy: str | None = None
        self.transfer_info: dict[Any, list[dict[str, Any]]] = {}
        self.router_map: dict[str, list[str]] = {}
        self.shared_weight_buffer_map: dict[Any, dict[str, Any]] = {}
        self._eval_task_submitter = TaskSubmitter(config.eval_max_pending, config.rpc_timeout_s)
        self._train_task_submitter = TaskSubmitter(config.train_max_pending, config.rpc_timeout_s)
        self.router_type = config.router_type
        self._uid = uuid.uuid4().hex[:10]
        self._lock = threading.RLock()  # membership, plans and versions (never held while serving)
        self._version = 0
        self._staged_version: int | None = None
        self._buffers_dirty = False
        self._node_readers: dict[Any, tuple[Any, frozenset[Any]]] = {}
        self._sharded_groups: dict[Any, str] = {}
        self._train_config: Any = None
        self._is_colocated = False
        self._node_of: dict[Hashable, Any] = {}
        self._gpu_of: dict[Hashable, Any] = {}
        self._node_label: dict[Any, Hashable] = {}
        self._plan = _SyncPlan()
        self._world: CommGroupPlan | None = None
        self._rank_of: dict[Hashable, int] = {}
        self._comm_backend = "gloo"
        self._groups_made: dict[tuple[int, ...], str] = {}
        self._rebuilds = 0
        self._layout: dict[str, Any] | None = None
        self._dead: set[Hashable] = set()
        self._inflight_refs: dict[int, Any] = {}
        self._inflight_lock = threading.Lock()
        self._owned_actors: list[Any] = []
        self._placement_groups: list[Any] = []
        self.router: Router[Hashable] = self._build_router()
        logger.info("[PolicyGroup] Using router: %s", type(self.router).__name__)

    # ================================================================== lists and names
    @property
    def eval_list(self) -> list[Policy]:
        return self.policy_list[PolicyRole.EVAL]

    @property
    def train_list(self) -> list[Policy]:
        return self.policy_list[PolicyRole.TRAIN]

    @property
    def weight_version(self) -> int:
        """The version of the last completed sync (0 before the first)."""
        return self._version

    @staticmethod
    def _wid(policy: Policy) -> Hashable:
        key: Hashable = actor_key(policy)
        return key

    def _name(self, policy: Policy) -> str:
        for role, lst in self.policy_list.items():
            for i, p in enumerate(lst):
                if p is policy or self._wid(p) == self._wid(policy):
                    return f"{role.value} policy {i}"
        return f"policy {self._wid(policy)}"

    def _names(self) -> dict[Hashable, str]:
        return {self._wid(p): self._name(p) for p in self.train_list + self.eval_list}

    def _by_wid(self, wid: Hashable) -> Policy | None:
        for p in self.eval_list + self.train_list:
            if self._wid(p) == wid:
                return p
        return None

    def _submitter_for(self, policy: Policy) -> TaskSubmitter:
        wid = self._wid(policy)
        if any(self._wid(p) == wid for p in self.train_list):
            return self._train_task_submitter
        return self._eval_task_submitter

    # ================================================================== calls
    @staticmethod
    def _invoke(policy: Policy, method: str, *args: Any, **kwargs: Any) -> Any:
        if is_remote(policy):
            return getattr(policy, method).remote(*args, **kwargs)
        try:
            return _Local(getattr(policy, method)(*args, **kwargs), None)
        except Exception as exc:
            return _Local(None, exc)

    def _gather(
        self, calls: Sequence[tuple[Policy, Any]], timeout: float, what: str
    ) -> list[tuple[Any, BaseException | None]]:
        """Wait for every call up to `timeout`; returns (value, error) per call, never hangs."""
        results: list[tuple[Any, BaseException | None]] = [(None, None)] * len(calls)
        remote = [(i, c) for i, (_, c) in enumerate(calls) if isinstance(c, ray.ObjectRef)]
        if remote:
            refs = [c for _, c in remote]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout, fetch_local=False)
            late = set(pending)
            for i, ref in remote:
                if ref in late:
                    results[i] = (
                        None,
                        TaskTimeoutError(
                            f"{what}: {self._name(calls[i][0])} did not finish within {timeout:.1f}s"
                        ),
                    )
                    continue
                try:
                    results[i] = (ray.get(ref, timeout=max(1.0, timeout)), None)
                except Exception as exc:
                    results[i] = (None, exc)
        for i, (_, c) in enumerate(calls):
            if isinstance(c, _Local):
                results[i] = (c.value, c.error)
        return results

    def _call_all(
        self, policies: Sequence[Policy], method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> list[Any]:
        """Call `method` on every policy at once; raise on the first failure (naming the policy)."""
        timeout = self.config.rpc_timeout_s if timeout is None else timeout
        calls = [(p, self._invoke(p, method, *args, **kwargs)) for p in policies]
        results = self._gather(calls, timeout, method)
        self._raise_failures([p for p, _ in calls], results, method)
        return [value for value, _ in results]

    def _raise_failures(
        self, policies: Sequence[Policy], results: Sequence[tuple[Any, BaseException | None]], what: str
    ) -> None:
        """Raise for the first failed call, a dead train policy first (its peers' errors follow from it)."""
        failed = [(p, err) for p, (_, err) in zip(policies, results, strict=True) if err is not None]
        if not failed:
            return
        for p, err in failed:
            if _is_dead(err) and any(p is t for t in self.train_list):
                self._raise_for(p, err, what)
        if any(is_remote(p) for p in self.train_list) and not any(_is_dead(e) for _, e in failed):
            self.check_liveness()  # a peer-lost error usually means a trainer died: name it
        self._raise_for(failed[0][0], failed[0][1], what)

    def _raise_for(self, policy: Policy, error: BaseException, what: str) -> None:
        name = self._name(policy)
        if _is_dead(error):
            if any(p is policy for p in self.train_list):
                raise TrainWorkerDiedError(
                    f"{what}: {name} died; its training state is lost: {error}"
                ) from None
            raise WorkerDiedError(f"{what}: {name} died: {error}") from None
        if isinstance(error, TaskTimeoutError):
            raise error
        raise PolicyGroupError(f"{what}: {name} failed: {_cause(error)}") from _cause(error)

    # ================================================================== routing
    def _build_router(self) -> Router[Hashable]:
        wids = [self._wid(p) for p in self.eval_list]
        if self.router_type == "node_affinity":
            dist = self.config.component_distribution
            if dist is None:
                raise ValueError(
                    "router_type 'node_affinity' needs PolicyConfig.component_distribution "
                    "({node: {'env': {'ids': [...]}, 'eval': {'ids': [...]}}}, "
                    "as the seed's resource manager)"
                )
            for node, comps in dist.items():
                for idx in comps.get("eval", {}).get("ids", []):
                    if 0 <= int(idx) < len(wids):
                        self._node_label[wids[int(idx)]] = node
            return create_router(self.rollout_mode, self.router_type, wids, component_distribution=dist)
        return create_router(self.rollout_mode, self.router_type, wids)

    def _router_add(self, policy: Policy) -> None:
        wid = self._wid(policy)
        node = self._node_label.get(wid)
        if node is None and isinstance(self.router, NodeAffinityRouter):
            real = self._node_of.get(wid)
            labels = {self._node_of.get(w): lab for w, lab in self._node_label.items()}
            node = labels.get(real, real)
        if wid in self.router:
            return
        # version 0 until init_weight_buffer reads the real one: a restarted worker pushed back
        # serves its initial weights, and must not look current to a newest-version router
        self.router.add_worker(wid, node=node, version=0)

    def _router_remove(self, policy: Policy) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.router.remove_worker(self._wid(policy))

    def _release_later(self, ref: Any, wid: Hashable, count: int) -> None:
        """Release `count` requests on `wid` when `ref` completes (callback, no polling)."""
        key = id(ref)
        with self._inflight_lock:
            self._inflight_refs[key] = ref  # a dropped ref would never call back

        def done(result: Any = None) -> None:
            with self._inflight_lock:
                self._inflight_refs.pop(key, None)
            if isinstance(result, BaseException) and _is_dead(_cause(result)):
                self._mark_dead(wid)
            for _ in range(count):
                try:
                    self.router.release(wid)
                except Exception:  # removed meanwhile with nothing in flight
                    break

        on_ready = getattr(ref, "_on_ready", None)
        if on_ready is not None:
            on_ready(done)
        else:  # older Ray: fetches the value, fine for completion
            ref._on_completed(done)

    def _mark_dead(self, wid: Hashable) -> None:
        self._dead.add(wid)
        with contextlib.suppress(UnknownWorkerError):
            self.router.remove_worker(wid)

    def rollout_batch(self, batched_env_ret: BatchedData[Any]) -> BatchedData[Any]:
        """Route each request (env id as key) and dispatch one task per eval policy per batch.

        Returns BatchedData(ids, responses): ObjectRefs for actors, values for local policies.
        """
        self._purge_dead()
        ids = batched_env_ret.ids()
        values = batched_env_ret.values()
        if not ids:
            return BatchedData([], [])
        workers = self.router.assign(ids, timeout=self.config.rpc_timeout_s)
        by_worker: dict[Hashable, list[int]] = {}
        for i, wid in enumerate(workers):
            by_worker.setdefault(wid, []).append(i)
        out: list[Any] = [None] * len(ids)
        for wid, idxs in by_worker.items():
            policy = self._by_wid(wid)
            if policy is None:
                for _ in idxs:
                    self.router.release(wid)
                raise WorkerDiedError(f"rollout_batch: worker {wid} left the group while routing")
            chunk = [values[i] for i in idxs]
            if is_remote(policy):
                method = policy._rollout_many
                refs = (
                    method.options(num_returns=len(idxs)).remote(chunk)
                    if len(idxs) > 1
                    else [method.remote(chunk)]
                )
                for i, ref in zip(idxs, refs, strict=True):
                    out[i] = ref
                self._release_later(refs[-1], wid, len(idxs))
            else:
                try:
                    results = (
                        policy.rollout_many_step(chunk) if len(chunk) > 1 else [policy._rollout(chunk[0])]
                    )
                finally:
                    for _ in idxs:
                        self.router.release(wid)
                for i, value in zip(idxs, results, strict=True):
                    out[i] = value
        return BatchedData(ids, out)

    def wait_idle(self, timeout: float = 60.0) -> int:
        """Wait until no routed request is in flight (completion callbacks ran); returns what is left."""
        end = time.monotonic() + timeout
        while self.router.in_flight and time.monotonic() < end:
            time.sleep(0.005)
        return self.router.in_flight

    def postprocess(
        self,
        batched_env_ret: BatchedData[Any] | None = None,
        batched_policy_resp: BatchedData[Any] | None = None,
    ) -> BatchedData[Any]:
        """Submit `_postprocess(env_ret, policy_resp)` per env id to a routed eval policy."""
        batched_args: list[list[Any]] = []
        if batched_env_ret is not None:
            batched_args.append(batched_env_ret.values())
        if batched_policy_resp is not None:
            batched_args.append(batched_policy_resp.values())
        source = batched_env_ret if batched_env_ret is not None else batched_policy_resp
        if source is None:
            raise ValueError("postprocess needs batched_env_ret or batched_policy_resp")
        env_ids = source.ids()
        out: list[Any] = []
        for env_id, args in zip(env_ids, zip(*batched_args, strict=True), strict=True):
            wid = self.router.select(env_id, timeout=self.config.rpc_timeout_s)
            policy = self._by_wid(wid)
            if policy is None:
                self.router.release(wid)
                raise WorkerDiedError(f"postprocess: worker {wid} left the group")
            try:
                result = self._eval_task_submitter.submit(policy._postprocess, *args)
            except BaseException:
                self.router.release(wid)
                raise
            if isinstance(result, ray.ObjectRef):
                self._release_later(result, wid, 1)
            else:
                self.router.release(wid)
            out.append(result)
        return BatchedData(env_ids, out)

    # ================================================================== init
    def init(self, train_config: TrainConfig, env_meta: Any = None, eval_config: Any = None) -> None:
        self.init_eval(eval_config, env_meta)
        self.init_train(train_config, env_meta)

    def init_eval(self, eval_config: Any = None, env_meta: Any = None) -> list[Any]:
        return self._call_all(self.eval_list, "init_eval", eval_config, env_meta)

    def init_train(self, train_config: Any, env_meta: Any = None) -> list[Any]:
        self._train_config = train_config
        return self._call_all(self.train_list, "init_train", train_config, env_meta)

    def _query_nodes(self, policies: Sequence[Policy]) -> None:
        todo = [p for p in policies if self._wid(p) not in self._node_of]
        if not todo:
            return
        nodes = self._call_all(todo, "_get_node_id")
        gpus = self._call_all(todo, "_get_gpu_ids")
        for p, node, gpu in zip(todo, nodes, gpus, strict=True):
            self._node_of[self._wid(p)] = node
            self._gpu_of[self._wid(p)] = gpu[0] if gpu else 0

    def node_of(self, policy: Policy) -> Any:
        """The node id a policy runs on ("local" for local objects)."""
        self._query_nodes([policy])
        return self._node_of[self._wid(policy)]

    def init_placement_info(self, is_colocated: bool = False) -> None:
        """Find each policy's node and plan who sends weights to whom (rlfleet.placement)."""
        with self._lock:
            self._is_colocated = is_colocated
            self._query_nodes(self.train_list + self.eval_list)
            info: dict[Any, dict[str, list[Policy]]] = {}
            for key, lst in (("train_policies", self.train_list), ("eval_policies", self.eval_list)):
                for p in lst:
                    entry = info.setdefault(
                        self._node_of[self._wid(p)], {"train_policies": [], "eval_policies": []}
                    )
                    entry[key].append(p)
            self.placement_info = info
            strategy = self.config.weight_buffer.buffer_strategy
            if not self.train_list:
                self.transfer_info = {}
            elif is_colocated:
                self.transfer_info = build_transfer_info_for_colocated(self.train_list, self.eval_list)
            else:
                self.transfer_info = build_transfer_info_for_disaggregated(
                    self.placement_info, "Double" if strategy == "Sharded" else strategy
                )
            self._plan = self._make_plan()
            logger.info(
                "placement_info: %s",
                {str(k)[:12]: {r: len(v) for r, v in e.items()} for k, e in info.items()},
            )

    def _make_plan(self) -> _SyncPlan:
        """Turn the seed-shaped transfer_info into segment writers, segment readers and broadcasts."""
        shared = self.config.weight_buffer.buffer_strategy == "Shared"
        plan = _SyncPlan()
        node = self._node_of

        def evals_on(n: Any) -> list[Policy]:
            return [p for p in self.eval_list if node[self._wid(p)] == n]

        items: list[tuple[Any, dict[str, Any]]] = [
            (n, it) for n, lst in self.transfer_info.items() for it in lst
        ]
        fed: set[Any] = set()  # nodes whose segment gets filled (Shared)
        for _, item in items:
            sender = item["sender"]
            receivers = item["receiver"] if isinstance(item["receiver"], list) else [item["receiver"]]
            s_node = node[self._wid(sender)]
            if item.get("intra_node") or (receivers and all(node[self._wid(r)] == s_node for r in receivers)):
                plan.writers.setdefault(s_node, sender)
                targets = evals_on(s_node) if shared else receivers
                for r in targets:
                    if all(r is not x for x in plan.readers[s_node]):
                        plan.readers[s_node].append(r)
                fed.add(s_node)
                continue
            for r in receivers:
                r_node = node[self._wid(r)]
                if shared and (r_node in fed):
                    if all(r is not x for x in plan.readers[r_node]):
                        plan.readers[r_node].append(r)
                    continue
                if shared:
                    fed.add(r_node)
                    plan.cross.append(_Cross(sender, [r], r_node))
                    for other in evals_on(r_node):
                        if other is not r and all(other is not x for x in plan.readers[r_node]):
                            plan.readers[r_node].append(other)
                else:
                    existing = [c for c in plan.cross if c.sender is sender and c.node == r_node]
                    if existing:
                        existing[0].receivers.append(r)
                    else:
                        plan.cross.append(_Cross(sender, [r], r_node))
        if shared:  # a Shared reader never also receives over the wire
            wire = {self._wid(r) for c in plan.cross for r in c.receivers}
            for n in list(plan.readers):
                plan.readers[n] = [r for r in plan.readers[n] if self._wid(r) not in wire]
        # reuse groups already made for the same members
        for c in plan.cross:
            members = self._members(c)
            if members is not None and members in self._groups_made:
                c.group_id = self._groups_made[members]
                c.src_rank = members[0]
        return plan

    def _members(self, c: _Cross) -> tuple[int, ...] | None:
        try:
            return (self._rank_of[self._wid(c.sender)], *(self._rank_of[self._wid(r)] for r in c.receivers))
        except KeyError:
            return None

    def init_weight_buffer(self) -> None:
        """Prepare every eval policy to receive weights with the configured strategy."""
        with self._lock:
            strategy = self.config.weight_buffer.buffer_strategy
            if strategy == "Sharded" and not all(is_remote(p) for p in self.train_list + self.eval_list):
                raise PolicyGroupError(
                    "buffer_strategy 'Sharded' needs Ray actors: a node's eval policies gather their "
                    "shards over a communication group at each swap"
                )
            self.weight_buffer_strategy = strategy
            if not self.train_list:
                return
            bucket_bytes = self.config.weight_buffer.bucket_bytes
            self._layout = self._call_all(self.train_list[:1], "get_weight_layout", bucket_bytes)[0]
            self.shared_weight_buffer_map = {}
            specs: dict[Any, dict[str, Any]] = {self._wid(p): {} for p in self.eval_list}
            self._call_all(self.train_list + self.eval_list, "release_weight_buffers")
            # one weightsync SharedBuffer per node, written once per version: with "Shared" every
            # eval of the node reads it zero-copy; otherwise the evals a trainer on their node
            # feeds copy each version out of it (checksummed if configured) into their own buffers
            for node, entry in self.placement_info.items():
                if strategy == "Shared":
                    readers = list(entry["eval_policies"])
                    writer = self._shared_writer_of(node) if readers else None
                else:
                    readers = list(self._plan.readers.get(node, []))
                    writer = self._plan.writers.get(node) if readers else None
                if writer is None:
                    continue
                [name] = self._call_all(
                    [writer],
                    "create_shared_writer",
                    self._layout,
                    len(readers),
                    f"rlfleet-{self._uid}",
                    self.config.weight_buffer.checksums,
                )
                spec = {"name": name, "node_id": node}
                self.shared_weight_buffer_map[node] = {
                    "shared_weight_buffer": spec,
                    "eval_policies": readers,
                    "writer": writer,
                }
                for p in readers:
                    specs[self._wid(p)].update(spec)
            if strategy == "Sharded":  # eval i of a node keeps share i of every version
                for entry in self.placement_info.values():
                    evals = entry["eval_policies"]
                    for i, p in enumerate(evals):
                        specs[self._wid(p)].update(rank=i, world_size=len(evals))
            self._node_readers = self._node_reader_signature()
            calls = [(p, specs[self._wid(p)] or None) for p in self.eval_list]
            refs = [
                (p, self._invoke(p, "init_weight_buffer", spec, strategy=strategy, layout=self._layout))
                for p, spec in calls
            ]
            for (p, _), (_, err) in zip(
                refs, self._gather(refs, self.config.rpc_timeout_s, "init_weight_buffer"), strict=True
            ):
                if err is not None:
                    self._raise_for(p, err, "init_weight_buffer")
            # a group built over workers that served an earlier group continues their numbering
            versions = self._call_all(self.train_list + self.eval_list, "get_weight_version")
            self._version = max([self._version, *versions])
            self._staged_version = None
            for p, v in zip(self.eval_list, versions[len(self.train_list) :], strict=True):
                self._router_add(p)
                self.router.set_version(self._wid(p), int(v))  # what it really serves

    def _node_reader_signature(self) -> dict[Any, tuple[Any, frozenset[Any]]]:
        """Who writes and who copies from each node's buffer ("None"/"Double"/"Sharded" plans)."""
        return {
            node: (self._wid(writer), frozenset(self._wid(r) for r in self._plan.readers.get(node, [])))
            for node, writer in self._plan.writers.items()
        }

    def _shared_writer_of(self, node: Any) -> Policy:
        """Who fills a node's shared buffer: its trainer, else the eval that receives for the node."""
        writer = self._plan.writers.get(node)
        if writer is not None:
            return writer
        for c in self._plan.cross:
            if c.node == node:
                return c.receivers[0]
        raise PolicyGroupError(f"no trainer or cross-node receiver fills the shared buffer of node {node!r}")

    def init_comm_group(self, backend: str = "nccl", is_colocated: bool = False) -> None:
        """Create the world group, intra-node groups, one group per cross-node transfer item and
        the train data-parallel group (rlfleet.placement's plan), on remote actors, bounded."""
        with self._lock:
            if not self.train_list and not self.eval_list:
                return
            everyone = self.train_list + self.eval_list
            if not all(is_remote(p) for p in everyone):
                return
            if backend == "nccl" and self.config.train_num_gpus == 0 and self.config.eval_num_gpus == 0:
                backend = "gloo"  # no GPUs: the seed's default backend cannot run
            self._comm_backend = backend
            if not self._node_of:
                self._query_nodes(everyone)
            sharded = self.config.weight_buffer.buffer_strategy == "Sharded"
            members = self.train_list if (is_colocated and not self._plan.cross and not sharded) else everyone
            actors = [
                (self._wid(p), self._node_of[self._wid(p)], self._gpu_of[self._wid(p)]) for p in members
            ]
            transfer = [
                {"sender": self._wid(c.sender), "receiver": [self._wid(r) for r in c.receivers]}
                for c in self._plan.cross
            ]
            plan = plan_comm_groups(
                actors, transfer, [self._wid(p) for p in self.train_list], weight_buffer_strategy="Double"
            )
            by_wid = {self._wid(p): p for p in members}
            rank = {r.actor_id: r.rank for r in plan.ranks}
            extra: list[CommGroup] = []
            self._sharded_groups = {}
            if sharded:  # one group per node's eval policies: they gather their shards at each swap
                for node, entry in self.placement_info.items():
                    evals = entry["eval_policies"]
                    if evals:
                        gid = f"sharded/{len(extra)}"
                        ranks = tuple(rank[self._wid(p)] for p in evals)
                        extra.append(CommGroup(gid, "sharded", ranks, node))
                        self._sharded_groups[node] = gid
            _comm.init_world(plan, by_wid, self._names(), backend, self.config.group_timeout_s, extra)
            self._world = plan
            self._rank_of = {r.actor_id: r.rank for r in plan.ranks}
            self._groups_made = {}
            for c, g in zip(self._plan.cross, plan.weight_transfer_groups, strict=True):
                c.group_id = g.group_id
                c.src_rank = g.src_rank
                self._groups_made[g.ranks] = g.group_id

    def _ensure_transfer_groups(self) -> None:
        """Create groups for cross items that have none yet (after a re-plan), members only."""
        missing = [c for c in self._plan.cross if c.group_id is None]
        if not missing:
            return
        if self._world is None:
            raise PolicyGroupError("cross-node weight transfer needs init_comm_group() first")
        groups = []
        for c in missing:
            ranks = self._members(c)
            if ranks is None:
                raise PolicyGroupError(
                    f"{self._name(c.sender)} or a receiver has no rank; call init_comm_group()"
                )
            self._rebuilds += 1
            gid = f"{ParallelMode.WEIGHT_TRANSFER.value}/r{self._rebuilds}"
            groups.append(CommGroup(gid, ParallelMode.WEIGHT_TRANSFER.value, ranks, c.node, ranks[0]))
            c.group_id, c.src_rank = gid, ranks[0]
            self._groups_made[ranks] = gid
        by_wid = {self._wid(p): p for p in self.train_list + self.eval_list}
        _comm.create_groups(
            self._world, groups, by_wid, self._names(), self._comm_backend, self.config.group_timeout_s
        )

    # ================================================================== faults
    def check_liveness(self, timeout: float = 10.0) -> list[str]:
        """Ping every policy; drop dead eval policies (returned by name); a dead trainer raises."""
        everyone = self.train_list + self.eval_list
        calls = [(p, self._invoke(p, "is_alive")) for p in everyone]
        dropped = []
        for (p, _), (_, err) in zip(calls, self._gather(calls, timeout, "is_alive"), strict=True):
            if _is_dead(err):
                if any(p is t for t in self.train_list):
                    raise TrainWorkerDiedError(f"{self._name(p)} died: {err}")
                dropped.append(self._name(p))
                self._drop_eval(p, str(err))
        return dropped

    def _purge_dead(self) -> None:
        if not self._dead:
            return
        with self._lock:
            for p in list(self.eval_list):
                if self._wid(p) in self._dead:
                    self._drop_eval(p, "its task failed with an actor error")
            self._dead.clear()

    def _drop_eval(self, policy: Policy, why: str) -> None:
        with self._lock:
            name = self._name(policy)
            logger.warning("[PolicyGroup] dropping %s: %s", name, why)
            self.policy_list[PolicyRole.EVAL] = [p for p in self.eval_list if p is not policy]
            self._router_remove(policy)
            self._eval_task_submitter.forget(policy)
            for entry in self.placement_info.values():
                entry["eval_policies"] = [p for p in entry["eval_policies"] if p is not policy]
            for entry in self.shared_weight_buffer_map.values():
                entry["eval_policies"] = [p for p in entry["eval_policies"] if p is not policy]
            self._replan()
            self._buffers_dirty = self.config.weight_buffer.buffer_strategy in ("Shared", "Sharded")

    def _replan(self) -> None:
        if not self.placement_info:
            return
        self.placement_info = {
            n: e for n, e in self.placement_info.items() if e["train_policies"] or e["eval_policies"]
        }
        strategy = self.config.weight_buffer.buffer_strategy
        if not self.train_list or not self.eval_list:
            self.transfer_info = {}
        elif self._is_colocated:
            self.transfer_info = build_transfer_info_for_colocated(self.train_list, self.eval_list)
        else:
            self.transfer_info = build_transfer_info_for_disaggregated(self.placement_info, strategy)
        self._plan = self._make_plan()

    # ================================================================== weight sync
    def send_weights(self) -> None:
        """Move the trainers' weights to every eval policy as the next version (staged)."""
        with self._lock:
            self._send(self._version + 1)

    def _send(self, version: int, retry: bool = True) -> None:
        if not self.train_list:
            raise PolicyGroupError("send_weights: the group has no train policy")
        if self.weight_buffer_strategy is None:
            raise PolicyGroupError("send_weights: call init_placement_info() and init_weight_buffer() first")
        self._purge_dead()
        if any(is_remote(p) for p in self.eval_list):
            self.check_liveness()
        if not self.eval_list:
            return
        self._ensure_transfer_groups()
        if self.weight_buffer_strategy != "Shared":
            # a re-plan can give a node's trainer new readers: they must attach to its buffer
            wired = self._node_reader_signature()
            before = self._node_readers
            self._buffers_dirty |= any(
                n not in before or wid != before[n][0] or not readers <= before[n][1]
                for n, (wid, readers) in wired.items()
            )
        if self._buffers_dirty:
            self._buffers_dirty = False
            self.init_weight_buffer()  # a node's shared-buffer writer or shard count changed
            if self.weight_buffer_strategy == "Sharded":  # gather groups must be torch groups: new world
                self.init_comm_group(self._comm_backend, self._is_colocated)
        strategy = self.weight_buffer_strategy
        bucket_bytes = self.config.weight_buffer.bucket_bytes
        timeout = self.config.sync_timeout_s
        if strategy == "None":
            self._drain(self.eval_list)
        try:
            calls: list[tuple[Policy, Any]] = []
            fills: dict[Any, Any] = {}
            for node, writer in self._plan.writers.items():
                if node not in self.shared_weight_buffer_map:
                    continue  # no eval on the node takes this trainer's bytes
                ref = self._invoke(writer, "publish_shared", version, timeout)
                calls.append((writer, ref))
                fills[node] = ref
            for c in self._plan.cross:
                calls.append(
                    (
                        c.sender,
                        self._invoke(c.sender, "send_broadcast", c.group_id, version, bucket_bytes, timeout),
                    )
                )
                for r in c.receivers:
                    ref = self._invoke(r, "recv_broadcast", c.group_id, c.src_rank, version, timeout)
                    calls.append((r, ref))
                    if strategy == "Shared":
                        fills[c.node] = ref
            for node, readers in self._plan.readers.items():
                dep = fills.get(node)
                if dep is None:
                    raise PolicyGroupError(f"send_weights: nothing fills the shared buffer of node {node!r}")
                dep_arg = dep if isinstance(dep, ray.ObjectRef) else None
                name = self.shared_weight_buffer_map[node]["shared_weight_buffer"]["name"]
                for r in readers:
                    calls.append((r, self._invoke(r, "stage_from_segment", name, version, dep_arg)))
            results = self._gather(calls, timeout, f"send_weights v{version}")
        except BaseException:
            if strategy == "None":
                self._undrain(self.eval_list)
            raise
        failed = [(p, err) for (p, _), (_, err) in zip(calls, results, strict=True) if err is not None]
        if not failed:
            if strategy == "None":
                self._finish_in_place(version)
            self._staged_version = version
            return
        for p, err in failed:
            if _is_dead(err) and any(p is t for t in self.train_list):
                raise TrainWorkerDiedError(f"send_weights v{version}: {self._name(p)} died: {err}") from None
        dead_before = len(self.eval_list)
        for p, err in failed:
            if _died_itself(p, err) and any(p is e for e in self.eval_list):
                self._drop_eval(p, f"died during send_weights v{version}")
        if any(is_remote(p) for p in self.eval_list):
            self.check_liveness()
        if strategy == "None":
            self._undrain(self.eval_list)
        if retry and len(self.eval_list) < dead_before:
            logger.warning(
                "[PolicyGroup] send_weights v%d: retrying for %d surviving eval policies",
                version,
                len(self.eval_list),
            )
            # "None" applied in place wherever the first try got through: resend as the next version
            self._send(version + 1 if strategy == "None" else version, retry=False)
            return
        p, err = min(failed, key=lambda f: _vagueness(f[1]))
        self._raise_for(p, err, f"send_weights v{version}")

    def _drain(self, policies: Sequence[Policy]) -> None:
        for p in policies:
            try:
                self.router.set_draining(self._wid(p), True)
            except UnknownWorkerError:
                continue
        try:
            for p in policies:
                try:
                    self.router.wait_drained(self._wid(p), self.config.drain_timeout_s)
                except UnknownWorkerError:
                    continue
        except BaseException:
            self._undrain(policies)  # a drain that times out must not leave them unroutable
            raise

    def _undrain(self, policies: Sequence[Policy]) -> None:
        for p in policies:
            try:
                self.router.set_draining(self._wid(p), False)
            except UnknownWorkerError:
                continue

    def _finish_in_place(self, version: int) -> None:
        for p in self.eval_list:
            with contextlib.suppress(UnknownWorkerError):
                self.router.set_version(self._wid(p), version)
        self._undrain(self.eval_list)
        self._version = version

    def notify_update_weights(self) -> None:
        """Apply the staged version as a rolling update: drain one eval policy, swap, undrain."""
        with self._lock:
            version = getattr(self, "_staged_version", None)
            if version is None or version <= self._version:
                return
            if self.weight_buffer_strategy == "None":
                self._version = version
                return
            if self.weight_buffer_strategy == "Sharded":
                self._apply_by_node(version)
                self._version = version
                return
            for p in list(self.eval_list):
                wid = self._wid(p)
                try:
                    self.router.set_draining(wid, True)
                except UnknownWorkerError:
                    continue
                try:
                    self.router.wait_drained(wid, self.config.drain_timeout_s)
                    [(_, err)] = self._gather(
                        [(p, self._invoke(p, "apply_staged", version))],
                        self.config.rpc_timeout_s,
                        "apply_staged",
                    )
                    if _is_dead(err):
                        self._drop_eval(p, f"died while applying v{version}")
                        continue
                    if err is not None:
                        self._raise_for(p, err, f"apply v{version}")
                    self.router.set_version(wid, version)
                finally:
                    if wid in self.router:
                        self.router.set_draining(wid, False)
            self._version = version

    def _apply_by_node(self, version: int) -> None:
        """With "Sharded" a node's eval policies gather together, so they swap together, node by node."""
        for node, gid in self._sharded_groups.items():
            evals = list(self.placement_info.get(node, {}).get("eval_policies", []))
            if not evals:
                continue
            self._drain(evals)
            try:
                calls = [(p, self._invoke(p, "apply_staged", version, None, gid)) for p in evals]
                results = self._gather(calls, self.config.rpc_timeout_s, f"apply v{version} on node {node}")
                self._raise_failures(evals, results, f"apply v{version}")
                for p in evals:
                    self.router.set_version(self._wid(p), version)
            finally:
                self._undrain(evals)

    def sync_weights(self) -> None:
        """Send the trainers' weights as the next version and apply it on every eval policy."""
        with self._lock:
            self.send_weights()
            self.notify_update_weights()

    def wait_for_eval_weight_update(self, timeout: float = 60.0) -> bool:
        """Block (up to `timeout`) until every eval policy has applied what it received."""
        calls = [(p, self._invoke(p, "wait_for_weight_update_done", timeout)) for p in self.eval_list]
        ok = True
        for i, ((p, _), (value, err)) in enumerate(
            zip(calls, self._gather(calls, timeout + 10.0, "wait_for_eval_weight_update"), strict=True)
        ):
            if err is not None or not value:
                ok = False
                logger.warning(
                    "[WeightConsistency] Eval policy %d (%s) weight update not done: %s",
                    i,
                    self._name(p),
                    err or "timed out",
                )
        return ok

    def eval_weight_versions(self) -> list[int]:
        """The weight version each eval policy serves, in eval_list order."""
        return [int(v) for v in self._call_all(self.eval_list, "get_weight_version")]

    def verify_eval_weight_consistency(self, rtol: float = 1e-3) -> bool:
        """Seed check: per-parameter L2 norms of each eval policy against train policy 0."""
        if self.weight_buffer_strategy not in (None, "None"):
            self.wait_for_eval_weight_update()
        ref: dict[str, float] = self._call_all(self.train_list[:1], "get_param_fingerprint")[0]
        all_ok = True
        for i, fp in enumerate(self._call_all(self.eval_list, "get_param_fingerprint")):
            problems = compare_fingerprints(ref, fp, rtol)
            if problems:
                all_ok = False
                logger.warning(
                    "[WeightConsistency] Eval policy %d has %d mismatched parameter(s): %s",
                    i,
                    len(problems),
                    "; ".join(problems[:10]),
                )
        return all_ok

    def verify_eval_weight_checksums(self) -> bool:
        """Exact check: every eval policy holds byte-identical weights to train policy 0."""
        ref = self._call_all(self.train_list[:1], "get_weight_checksum")[0]
        sums = self._call_all(self.eval_list, "get_weight_checksum")
        bad = [i for i, s in enumerate(sums) if s != ref]
        if bad:
            logger.warning("[WeightConsistency] eval policies %s differ from train policy 0", bad)
        return not bad

    # ================================================================== training
    def reset_training_state(
        self, train_config: TrainConfig, env_meta: Any = None, seed: int | None = None
    ) -> None:
        self._call_all(self.train_list, "reset_training_state", train_config, env_meta, seed)
        self._call_all(self.train_list, "dist_barrier", ParallelMode.TRAIN_DATA_PARALLEL.value)

    def update_dataset(self, sample_data: list[Any]) -> list[Any]:
        if len(sample_data) != len(self.train_list):
            raise ValueError(
                f"update_dataset: {len(sample_data)} shards for {len(self.train_list)} train policies"
            )
        return [
            self._train_task_submitter.submit(p.update_dataset, d)
            for p, d in zip(self.train_list, sample_data, strict=True)
        ]

    def train(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        refs = [self._train_task_submitter.submit(p.train, *args, **kwargs) for p in self.train_list]
        calls = list(
            zip(
                self.train_list,
                [r if isinstance(r, ray.ObjectRef) else _Local(r, None) for r in refs],
                strict=True,
            )
        )
        results = self._gather(calls, self.config.rpc_timeout_s, "train")
        self._raise_failures(self.train_list, results, "train")
        info: dict[str, float] = results[0][0]
        return info

    def save_checkpoint(self, path: str) -> None:
        self._call_all(self.train_list[:1], "save_checkpoint", path)

    def print_timing_summary(self, reset: bool = False) -> None:
        self._call_all(self.train_list + self.eval_list, "print_timing_summary", reset)

    def offload_eval_model(self) -> None:
        self._call_all(self.eval_list, "offload_model")

    def reload_eval_model(self) -> None:
        self._call_all(self.eval_list, "reload_model")

    def offload_model_optimizer(self) -> None:
        self._call_all(self.train_list, "offload_optimizer")

    def offload_model_param_and_grad(self, offload_grad: bool = True, offload_optimizer: bool = True) -> None:
        self._call_all(self.train_list, "offload_model_param_and_grad", offload_grad=offload_grad)
        if offload_optimizer:
            self._call_all(self.train_list, "offload_optimizer")

    def reload_model_param_and_grad(self, load_grad: bool = True, load_optimizer: bool = True) -> None:
        self._call_all(self.train_list, "reload_model_param_and_grad", load_grad=load_grad)
        if load_optimizer:
            self._call_all(self.train_list, "reload_optimizer")

    # ================================================================== membership
    def push(self, policy_worker: Policy, role: PolicyRole) -> None:
        """Add a worker to a role (call the init_* steps again to wire it in)."""
        role = PolicyRole(role)
        self.policy_list[role].append(policy_worker)
        if role == PolicyRole.EVAL:
            self._router_add(policy_worker)

    def pop(self, role: PolicyRole) -> Policy:
        role = PolicyRole(role)
        policy = self.policy_list[role].pop()
        if role == PolicyRole.EVAL:
            self._router_remove(policy)
        return policy

    def _rewire(self) -> None:
        """After a role change: placement, buffers, groups rebuilt, then weights made consistent."""
        self._call_all(self.train_list + self.eval_list, "release_weight_buffers")
        self.init_placement_info(self._is_colocated)
        self.init_weight_buffer()
        self.init_comm_group(self._comm_backend, self._is_colocated)
        self.sync_weights()

    def convert_train_to_eval(self, num: int) -> None:
        """Turn the last `num` train policies into eval policies (at least one trainer stays)."""
        with self._lock:
            if not 0 < num < len(self.train_list):
                raise ValueError(
                    f"convert_train_to_eval({num}): have {len(self.train_list)} train policies, "
                    "at least one must stay"
                )
            moved = self.train_list[-num:]
            self.policy_list[PolicyRole.TRAIN] = self.train_list[:-num]
            base = len(self.eval_list)
            self._call_all(moved, "finalize_async_save")
            for i, p in enumerate(moved):
                self._call_all([p], "set_role", PolicyRole.EVAL.value, base + i)
                self._train_task_submitter.forget(p)
                self.eval_list.append(p)
                self._call_all([p], "init_eval", None, None)
                self._router_add(p)
            self._rewire()

    def convert_eval_to_train(self, num: int) -> None:
        """Turn the last `num` eval policies into train policies (at least one eval stays)."""
        with self._lock:
            if not 0 < num < len(self.eval_list):
                raise ValueError(
                    f"convert_eval_to_train({num}): have {len(self.eval_list)} eval policies, "
                    "at least one must stay"
                )
            if not self.train_list:
                raise PolicyGroupError(
                    "convert_eval_to_train: no train policy to copy the training state from"
                )
            moved = self.eval_list[-num:]
            self._drain(moved)
            for p in moved:
                self._router_remove(p)
                self._eval_task_submitter.forget(p)
            self.policy_list[PolicyRole.EVAL] = self.eval_list[:-num]
            state = self._call_all(self.train_list[:1], "get_training_state")[0]
            base = len(self.train_list)
            for i, p in enumerate(moved):
                self._call_all([p], "set_role", PolicyRole.TRAIN.value, base + i)
                self._call_all([p], "init_train", state.get("train_config"), None)
                self._call_all([p], "load_training_state", state)  # model and optimizer in step
                self.train_list.append(p)
            self._rewire()

    # ================================================================== shutdown
    def shutdown(self) -> None:
        """Release weight segments on every worker; kill actors the builder created."""
        everyone = self.train_list + self.eval_list
        calls = [(p, self._invoke(p, "release_weight_buffers")) for p in everyone]
        self._gather(calls, 30.0, "release_weight_buffers")
        for actor in self._owned_actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._owned_actors = []
        for pg in self._placement_groups:
            with contextlib.suppress(Exception):
                ray.util.remove_placement_group(pg)
        self._placement_groups = []
        with self._inflight_lock:
            self._inflight_refs.clear()


__all__ = ["BasePolicy", "PolicyGroup", "resolve_object"]
