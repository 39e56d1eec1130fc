"""Rollouts: requests routed to rollout workers (rlfleet.routing) and dispatched as Ray tasks.

The router keeps the in-flight count of each worker locally: a request is counted when routed
and released by a completion callback on its task (no RPC to every worker per batch, as the
seed did). A batch becomes one task per worker with one return object per request. A worker
whose task fails with an actor error is marked dead; the group drops it before its next call.
Draining (for a weight swap or a role change) stops routing to a worker and waits until its
requests finished.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import ray

from rlfleet.policygroup._batched import BatchedData
from rlfleet.policygroup._calls import Policy, Roster, cause, is_dead
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import WorkerDiedError
from rlfleet.policygroup._submitter import TaskSubmitter, is_remote
from rlfleet.routing import NodeAffinityRouter, Router, UnknownWorkerError, create_router


class Rollouts:
    """Routing and dispatch of rollout and postprocess requests over the roster's rollout workers."""

    def __init__(self, roster: Roster, config: PolicyConfig, submitter: TaskSubmitter) -> None:
        self.roster = roster
        self.config = config
        self.submitter = submitter
        self.dead: set[Hashable] = set()  # workers whose task died; dropped before the next call
        self._node_label: dict[Hashable, Any] = {}  # worker -> node label of the seed's distribution
        self._inflight: dict[int, Any] = {}  # refs awaiting their completion callback
        self._inflight_lock = threading.Lock()
        self.router: Router[Hashable] = self._build_router()

    def _build_router(self) -> Router[Hashable]:
        wids = [self.roster.wid(p) for p in self.roster.eval_list]
        if self.config.router_type != "node_affinity":
            return create_router(self.config.rollout_mode, self.config.router_type, wids)
        dist = self.config.component_distribution
        if dist is None:
            raise ValueError(
                "router_type 'node_affinity' needs PolicyConfig.component_distribution "
                "({node: {'env': {'ids': [...]}, 'eval': {'ids': [...]}}}, as the seed's resource manager)"
            )
        for node, comps in dist.items():
            for idx in comps.get("eval", {}).get("ids", []):
                if 0 <= int(idx) < len(wids):
                    self._node_label[wids[int(idx)]] = node
        return create_router(self.config.rollout_mode, "node_affinity", wids, component_distribution=dist)

    # -- membership ---------------------------------------------------------------------
    def add(self, policy: Policy, node_of: Mapping[Hashable, Any]) -> None:
        """Route to `policy` from now on (at version 0 until the group tells its real one)."""
        wid = self.roster.wid(policy)
        if wid in self.router:
            return
        node = self._node_label.get(wid)
        if node is None and isinstance(self.router, NodeAffinityRouter):
            labels = {node_of.get(w): label for w, label in self._node_label.items()}
            node = labels.get(node_of.get(wid), node_of.get(wid))
        # a restarted worker pushed back serves its initial weights: it must not look current
        self.router.add_worker(wid, node=node, version=0)

    def remove(self, policy: Policy) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.router.remove_worker(self.roster.wid(policy))

    def set_version(self, policy: Policy, version: int) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.router.set_version(self.roster.wid(policy), version)

    def drain(self, policies: Sequence[Policy]) -> None:
        """Stop routing to `policies` and wait until their requests finished (bounded)."""
        self._set_draining(policies, True)
        try:
            for p in policies:
                with contextlib.suppress(UnknownWorkerError):
                    self.router.wait_drained(self.roster.wid(p), self.config.drain_timeout_s)
        except BaseException:
            self.undrain(policies)  # a drain that times out must not leave them unroutable
            raise

    def undrain(self, policies: Sequence[Policy]) -> None:
        self._set_draining(policies, False)

    def _set_draining(self, policies: Sequence[Policy], draining: bool) -> None:
        for p in policies:
            with contextlib.suppress(UnknownWorkerError):
                self.router.set_draining(self.roster.wid(p), draining)

    # -- completion -----------------------------------------------------------------------
    def _release_later(self, ref: Any, wid: Hashable, count: int) -> None:
        """Release `count` requests on `wid` when `ref` completes (a callback, no polling)."""
        key = id(ref)
        with self._inflight_lock:
            self._inflight[key] = ref  # a dropped ref would never call back

        def done(result: Any = None) -> None:
            with self._inflight_lock:
                self._inflight.pop(key, None)
            if isinstance(result, BaseException) and is_dead(cause(result)):
                self.dead.add(wid)
                self.remove_wid(wid)
            for _ in range(count):
                try:
                    self.router.release(wid)
                except Exception:  # removed meanwhile with nothing in flight
                    break

        ref._on_ready(done)

    def remove_wid(self, wid: Hashable) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.router.remove_worker(wid)

    def forget_inflight(self) -> None:
        with self._inflight_lock:
            self._inflight.clear()

    def wait_idle(self, timeout: float = 60.0) -> int:
        """Wait until no routed request is in flight (callbacks ran); returns what is left."""
        end = time.monotonic() + timeout
        while self.router.in_flight and time.monotonic() < end:
            time.sleep(0.005)
        return self.router.in_flight

    # -- dispatch -------------------------------------------------------------------------
    def _worker(self, wid: Hashable, count: int, what: str) -> Policy:
        policy = self.roster.by_wid(wid)
        if policy is None:
            for _ in range(count):
                self.router.release(wid)
            raise WorkerDiedError(f"{what}: worker {wid} left the group while routing")
        return policy

    def rollout_batch(self, batch: BatchedData[Any]) -> BatchedData[Any]:
        """Route each request (env id as key); one task per worker per batch."""
        ids, values = batch.ids(), batch.values()
        if not ids:
            return BatchedData([], [])
        by_worker: dict[Hashable, list[int]] = {}
        for i, wid in enumerate(self.router.assign(ids, timeout=self.config.rpc_timeout_s)):
            by_worker.setdefault(wid, []).append(i)
        out: list[Any] = [None] * len(ids)
        for wid, idxs in by_worker.items():
            policy = self._worker(wid, len(idxs), "rollout_batch")
            chunk = [values[i] for i in idxs]
            if is_remote(policy):
                method = policy._rollout_many
                many = method.options(num_returns=len(idxs)).remote(chunk) if len(idxs) > 1 else None
                results = many if many is not None else [method.remote(chunk)]
                self._release_later(results[-1], wid, len(idxs))
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

    def postprocess(self, env_ids: Sequence[Any], batched_args: Sequence[Sequence[Any]]) -> BatchedData[Any]:
        """Submit `_postprocess(*args)` per env id to a routed rollout worker."""
        out: list[Any] = []
        for env_id, args in zip(env_ids, zip(*batched_args, strict=True), strict=True):
            wid = self.router.select(env_id, timeout=self.config.rpc_timeout_s)
            policy = self._worker(wid, 1, "postprocess")
            try:
                result = self.submitter.submit(policy._postprocess, *args)
            except BaseException:
                self.router.release(wid)
                raise
            if isinstance(result, ray.ObjectRef):
                self._release_later(result, wid, 1)
            else:
                self.router.release(wid)
            out.append(result)
        return BatchedData(list(env_ids), out)
