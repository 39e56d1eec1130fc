"""Rollouts: requests routed to rollout workers (rlfleet.routing) and dispatched as Ray tasks.

The router counts a request when it is routed and a completion callback on its task releases
it (no RPC per batch, as the seed did); a batch is one task per worker, one return object per
request, plus one for the weight version that served them (async RL: every sample says which
weights made it). A worker whose task fails with an actor error is marked dead and dropped by
the group before its next call. The router bounds staleness (`PolicyConfig.max_staleness`): the
group announces each committed version (`announce`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import ray

from rlfleet.policygroup._batched import BatchedData
from rlfleet.policygroup._config import PolicyConfig
from rlfleet.policygroup._errors import PolicyGroupError, WorkerDiedError
from rlfleet.policygroup.driver._calls import Policy, Roster, cause, is_dead
from rlfleet.policygroup.driver._submitter import TaskSubmitter, is_remote
from rlfleet.routing import NodeAffinityRouter, Router, UnknownWorkerError, create_router


class Rollouts:
    """Routing and dispatch of rollout and postprocess requests over the roster's rollout workers."""

    def __init__(self, roster: Roster, config: PolicyConfig, submitter: TaskSubmitter) -> None:
        self.roster, self.config, self.submitter = roster, config, submitter
        self.dead: set[Hashable] = set()  # workers whose task died; dropped before the next call
        self._inflight: dict[int, Any] = {}  # refs awaiting their completion callback
        self._inflight_lock = threading.Lock()
        wids = [roster.wid(p) for p in roster.eval_list]
        extra: dict[str, Any] = {}
        if config.router_type == "node_affinity":
            if config.component_distribution is None:
                raise ValueError(
                    "router_type 'node_affinity' needs PolicyConfig.component_distribution ({node: "
                    "{'env': {'ids': [...]}, 'eval': {'ids': [...]}}}, as the seed's resource manager)"
                )
            extra["component_distribution"] = config.component_distribution
        if config.router_type == "prefix_aware":
            extra["on_new_version"] = config.on_new_version
        extra["max_staleness"] = config.max_staleness
        self.router: Router[Hashable] = create_router(config.rollout_mode, config.router_type, wids, **extra)

    # -- membership ---------------------------------------------------------------------
    def add(self, policy: Policy, node_of: Mapping[Hashable, Any]) -> None:
        """Route to `policy` once it applied the group's next version: a worker that joins (a
        restarted one pushed back serves its initial weights) is drained until its first swap."""
        wid = self.roster.wid(policy)
        if wid in self.router:
            return
        node = None
        if isinstance(self.router, NodeAffinityRouter):  # the label of a worker on its Ray node
            known = {w: self.router.node(w) for w in self.router.workers}
            labels = {node_of.get(w): label for w, label in known.items() if label is not None}
            node = labels.get(node_of.get(wid), node_of.get(wid))
        self.router.add_worker(wid, node=node, version=0)
        self.router.set_draining(wid, True)

    def remove(self, policy: Policy) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.router.remove_worker(self.roster.wid(policy))

    def set_version(self, policy: Policy, version: int) -> None:
        with contextlib.suppress(UnknownWorkerError):
            self.router.set_version(self.roster.wid(policy), version)

    def announce(self, version: int) -> None:
        """A sync committed `version`: workers more than `max_staleness` behind it take nothing."""
        self.router.set_latest_version(version)

    def drain(self, policies: Sequence[Policy]) -> None:
        """Stop routing to `policies` and wait until their requests finished (bounded)."""
        self.router.drain([self.roster.wid(p) for p in policies], self.config.drain_timeout_s)

    def undrain(self, policies: Sequence[Policy]) -> None:
        self.router.undrain([self.roster.wid(p) for p in policies])

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
                with contextlib.suppress(UnknownWorkerError):
                    self.router.remove_worker(wid)
            self._release(wid, count)

        ref._on_ready(done)

    def _release(self, wid: Hashable, count: int) -> None:
        for _ in range(count):
            try:
                self.router.release(wid)
            except Exception:  # removed meanwhile with nothing in flight
                break

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
            self._release(wid, count)
            raise WorkerDiedError(f"{what}: worker {wid} left the group while routing")
        return policy

    def _require_workers(self, what: str) -> None:
        """A request with no rollout worker at all fails now, not at the end of its deadline."""
        if len(self.router) == 0:
            raise PolicyGroupError(
                f"{what}: the group has no rollout worker (built with num_eval=0, or every one was "
                "dropped); add one with push() or convert_train_to_eval()"
            )

    @staticmethod
    def _check_batch(batch: BatchedData[Any]) -> tuple[list[Any], list[Any]]:
        if not (callable(getattr(batch, "ids", None)) and callable(getattr(batch, "values", None))):
            raise TypeError(
                f"rollout_batch takes a BatchedData (env ids and their env returns; any object with "
                f"ids() and values()), got {type(batch).__name__}: wrap a list x as "
                "BatchedData(list(range(len(x))), x)"
            )
        return list(batch.ids()), list(batch.values())

    def rollout_batch(self, batch: BatchedData[Any]) -> BatchedData[Any]:
        """Route each request (env id as key); one task per worker per batch."""
        ids, values = self._check_batch(batch)
        if ids:
            self._require_workers("rollout_batch")
        by_worker: dict[Hashable, list[int]] = {}
        for i, wid in enumerate(self.router.assign(ids, timeout=self.config.rpc_timeout_s) if ids else []):
            by_worker.setdefault(wid, []).append(i)
        out: list[Any] = [None] * len(ids)
        versions: list[Any] = [None] * len(ids)
        for wid, idxs in by_worker.items():
            results, version = self._dispatch(wid, [values[i] for i in idxs])
            for i, value in zip(idxs, results, strict=True):
                out[i], versions[i] = value, version
        return BatchedData(ids, out, versions)

    def _dispatch(self, wid: Hashable, chunk: list[Any]) -> tuple[list[Any], Any]:
        """One task on `wid` for `chunk` (already counted in flight): its responses and the
        weight version that served them (ObjectRefs from an actor)."""
        policy, n = self._worker(wid, len(chunk), "rollout_batch"), len(chunk)
        if is_remote(policy):
            method = getattr(policy, "_rollout_versioned", None)
            if method is None:  # a duck-typed worker: the version the router knows it serves
                version = self.router.version(wid)
                plain = policy._rollout_many
                refs = plain.options(num_returns=n).remote(chunk) if n > 1 else [plain.remote(chunk)]
                self._release_later(refs[-1], wid, n)
                return list(refs), version
            refs = method.options(num_returns=n + 1).remote(chunk)
            self._release_later(refs[-1], wid, n)
            return list(refs[:-1]), refs[-1]
        try:
            *results, version = policy._rollout_versioned(chunk)
        finally:
            self._release(wid, n)
        return results, int(version)

    async def rollout_batch_async(self, batch: BatchedData[Any], timeout: float) -> BatchedData[Any]:
        """`rollout_batch` for asyncio: routing waits (within `timeout`) without blocking the loop,
        for a worker recent enough under `max_staleness`; values and versions come back resolved."""
        ids, values = self._check_batch(batch)
        if ids:
            self._require_workers("rollout_batch_async")
        loop = asyncio.get_running_loop()
        due = loop.time() + timeout
        by_worker: dict[Hashable, list[int]] = {}
        try:
            for i, env_id in enumerate(ids):
                wid = await self.router.select_async(env_id, timeout=max(1e-3, due - loop.time()))
                by_worker.setdefault(wid, []).append(i)
        except BaseException:
            for wid, idxs in by_worker.items():
                self._release(wid, len(idxs))
            raise
        out: list[Any] = [None] * len(ids)
        versions: list[Any] = [None] * len(ids)
        pending = [
            (idxs, self._dispatch_async(wid, [values[i] for i in idxs])) for wid, idxs in by_worker.items()
        ]
        done = await asyncio.wait_for(
            asyncio.gather(*(task for _, task in pending)), timeout=max(1e-3, due - loop.time())
        )
        for (idxs, _), (results, version) in zip(pending, done, strict=True):
            for i, value in zip(idxs, results, strict=True):
                out[i], versions[i] = value, int(version)
        return BatchedData(ids, out, versions)

    async def _dispatch_async(self, wid: Hashable, chunk: list[Any]) -> tuple[list[Any], Any]:
        policy = self.roster.by_wid(wid)
        if policy is not None and not is_remote(policy):
            try:  # a local policy computes in a thread: the loop keeps running
                *results, version = await asyncio.to_thread(policy._rollout_versioned, chunk)
            finally:
                self._release(wid, len(chunk))
            return results, version
        refs, version = self._dispatch(wid, chunk)
        results = list(await asyncio.gather(*refs))
        return results, (await version if isinstance(version, ray.ObjectRef) else version)

    def postprocess(self, env_ids: Sequence[Any], batched_args: Sequence[Sequence[Any]]) -> BatchedData[Any]:
        """Submit `_postprocess(*args)` per env id to a routed rollout worker."""
        out: list[Any] = []
        if env_ids:
            self._require_workers("postprocess")
        for env_id, args in zip(env_ids, zip(*batched_args, strict=True), strict=True):
            wid = self.router.select(env_id, timeout=self.config.rpc_timeout_s)
            try:
                result = self.submitter.submit(self._worker(wid, 0, "postprocess")._postprocess, *args)
            except BaseException:
                self._release(wid, 1)
                raise
            if isinstance(result, ray.ObjectRef):
                self._release_later(result, wid, 1)
            else:
                self._release(wid, 1)
            out.append(result)
        return BatchedData(list(env_ids), out)
