"""The seed's routers, re-implemented without Ray (rlightning PolicyGroup + utils/router), as
baselines for benchmarks/routing.py. Loads the seed reads by Ray RPC are read locally here, so
the baselines are generous.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Sequence


def seed_heap_assign(current_loads: Sequence[int], num_tasks: int) -> list[int]:
    """The seed's async SimpleRouter.assign, as written there."""
    heap = [(int(current_loads[i]), i) for i in range(len(current_loads))]
    if not heap:
        raise ValueError("No policies available for routing")
    heapq.heapify(heap)
    assignments: list[int] = []
    for _ in range(num_tasks):
        load, idx = heapq.heappop(heap)
        assignments.append(idx)
        heapq.heappush(heap, (load + 1, idx))
    return assignments


class SeedPolicy:
    """An eval policy as the seed's routers see it: counts its own requests."""

    __slots__ = ("name", "num_requests")

    def __init__(self, name: int) -> None:
        self.name = name
        self.num_requests = 0

    def get_num_requests(self) -> int:  # a Ray RPC in the seed's async rollout_batch
        return self.num_requests

    def check_idle(self) -> bool:  # a Ray RPC in the seed's sync routers
        return self.num_requests == 0


class SeedAsyncPath:
    """rollout_batch in async mode: fresh loads from every policy, then the heap."""

    def __init__(self, n: int) -> None:
        self.eval_list = [SeedPolicy(i) for i in range(n)]

    def route_batch(self, num_tasks: int) -> list[int]:
        current_loads = [p.get_num_requests() for p in self.eval_list]
        assignments = seed_heap_assign(current_loads, num_tasks)
        for idx in assignments:
            self.eval_list[idx].num_requests += 1  # the actor counts the request it received
        return assignments

    def finish(self, idx: int) -> None:
        self.eval_list[idx].num_requests -= 1


class SeedSyncSimpleRouter:
    """SyncSimpleRouter: an idle deque under one global lock, probing busy policies."""

    def __init__(self, n: int) -> None:
        self._eval_policies = [SeedPolicy(i) for i in range(n)]
        self._idle_deque: deque[SeedPolicy] = deque(self._eval_policies)
        self._lock = threading.Lock()
        self.slept = 0.0  # seconds spent in the seed's 10 ms waits (CPU time does not see them)

    def _flush_idle(self) -> None:
        busy_list = list(set(self._eval_policies) - set(self._idle_deque))
        if not busy_list:
            return
        idle = [p for p in busy_list if p.check_idle()]
        if not idle:
            time.sleep(0.01)  # ray.wait(futures, timeout=0.01) found nothing finished
            self.slept += 0.01
        self._idle_deque.extend(idle)

    def select_policy(self, env_id: str | None = None) -> SeedPolicy:
        with self._lock:
            while len(self._idle_deque) == 0:
                self._flush_idle()
            # The seed pops after leaving the lock (a race with several threads); popped
            # inside here so the 8-thread run does not crash on an empty deque.
            policy = self._idle_deque.popleft()
        policy.num_requests += 1
        return policy

    @staticmethod
    def finish(policy: SeedPolicy) -> None:
        policy.num_requests -= 1


class SeedSyncNodeAffinityRouter:
    """SyncNodeAffinityRouter.select_policy: round-robin within the env's node, per-node locks."""

    def __init__(self, n: int, env_to_node: dict[int, int], node_policies: dict[int, list[int]]) -> None:
        self._eval_policies = list(range(n))
        self._env_worker_to_node = env_to_node
        self._node_to_eval_policies = node_policies
        self._rr_counters = dict.fromkeys(node_policies, 0)
        self._global_rr_counter = 0
        self._node_locks = {node: threading.Lock() for node in node_policies}
        self._global_lock = threading.Lock()

    @staticmethod
    def _parse_env_worker_index(env_id: str) -> int | None:
        try:
            return int(env_id.rsplit("-", 1)[-1])
        except (ValueError, AttributeError):
            return None

    def _get_target_node(self, env_id: str) -> int | None:
        worker_idx = self._parse_env_worker_index(env_id)
        if worker_idx is None:
            return None
        return self._env_worker_to_node.get(worker_idx)

    def select_policy(self, env_id: str) -> int:
        target = self._get_target_node(env_id)
        if target is not None and target in self._node_to_eval_policies:
            policies = self._node_to_eval_policies[target]
            with self._node_locks[target]:
                idx = self._rr_counters[target] % len(policies)
                self._rr_counters[target] += 1
            return policies[idx]
        with self._global_lock:
            idx = self._global_rr_counter % len(self._eval_policies)
            self._global_rr_counter += 1
        return self._eval_policies[idx]
