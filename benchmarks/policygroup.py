"""Policy-group claims, measured side by side against faithful re-implementations of the seed.

Run: hatch run python benchmarks/policygroup.py [--quick] [--json PATH]

rollout_overhead_vs_seed
    Per-request overhead of `rollout_batch` + collecting the responses, no-op policies on 16 eval
    actors. Seed (async mode): one `get_num_requests` RPC to every eval actor per batch, the heap
    assignment (`least_load_assign`), then one `_rollout_async` task per request. Ours: routing
    with locally kept in-flight counts (released by completion callbacks), one task per eval
    actor per batch with one return object per request. Target: at least 3x less.
rollout_overhead_vs_seed_one_per_worker
    The same with batches of one request per worker (no batching gain left: the RPCs alone).
sync_speedup_vs_seed
    `sync_weights` of a 256 MiB model (quick: 32 MiB) from one trainer to 4 eval actors on 2 Ray
    nodes (trainer + 2 evals | 2 evals). Seed ("Shared"): per-dtype `parameters_to_vector` +
    broadcast to the remote node's first eval, and one Ray actor per node holding numpy arrays in
    the object store that every eval loads from. Ours ("Shared"): the trainer writes the node's
    shared-memory segment once, a bucketed broadcast fills the remote node's segment, eval actors
    rebind zero-copy views. Reported as a ratio (seed time / our time).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from typing import Any

from _claims import arguments, claim, report

MiB = 1024 * 1024


def log(msg: str) -> None:
    print(f"[policygroup bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ no-op rollout actor (no torch)
class NoopEval:
    """Answers both the seed's calls (its `_rollout_async`, kept here as the baseline) and ours;
    imports nothing, so 16 actors start quickly."""

    def __init__(self) -> None:
        self.n = 0

    def get_num_requests(self) -> int:
        return self.n

    def _rollout_async(self, env_ret: Any) -> Any:
        self.n += 1
        self.n -= 1
        return env_ret

    def _rollout_many(self, env_rets: list[Any]) -> Any:
        self.n += len(env_rets)
        self.n -= len(env_rets)
        return env_rets[0] if len(env_rets) == 1 else tuple(env_rets)

    def is_alive(self) -> bool:
        return True


def seed_rollout_batch(eval_list: list[Any], batch: Any) -> Any:
    """The seed's async `rollout_batch`, verbatim in behaviour."""
    import ray

    from rlfleet.policygroup import BatchedData
    from rlfleet.routing import least_load_assign

    current_loads = ray.get([p.get_num_requests.remote() for p in eval_list])
    assignments = least_load_assign(current_loads, len(batch))
    pairs = zip(batch.values(), assignments, strict=True)
    refs = [eval_list[idx]._rollout_async.remote(env_ret) for env_ret, idx in pairs]
    return BatchedData(batch.ids(), refs)


def bench_rollout(workers: int, batch_size: int, batches: int) -> tuple[float, float]:
    """(seed µs per request, ours µs per request), interleaved rounds, medians."""
    import ray

    from rlfleet.policygroup import BatchedData, PolicyConfig, PolicyGroup

    remote = ray.remote(NoopEval)
    actors = [remote.options(num_cpus=0, max_concurrency=16).remote() for _ in range(workers)]
    ray.get([a.is_alive.remote() for a in actors], timeout=300)
    group = PolicyGroup([], actors, PolicyConfig(rollout_mode="async", router_type="simple"))
    batch = BatchedData([f"env-{i}" for i in range(batch_size)], list(range(batch_size)))

    def run(fn: Any) -> float:
        start = time.perf_counter()
        for _ in range(batches):
            out = fn(batch)
            values = ray.get(out.values(), timeout=120)
            assert list(values) == batch.values()
        return (time.perf_counter() - start) / (batches * batch_size) * 1e6

    run(lambda b: seed_rollout_batch(actors, b))  # warm up both paths
    run(group.rollout_batch)
    seed, ours = [], []
    for _ in range(3):
        seed.append(run(lambda b: seed_rollout_batch(actors, b)))
        ours.append(run(group.rollout_batch))
    group.wait_idle(30)
    for a in actors:
        ray.kill(a)
    return statistics.median(seed), statistics.median(ours)


# ------------------------------------------------------------------ weight sync
def make_bench_policy(model_mib: int) -> Any:
    import numpy as np
    import ray
    import torch
    from torch import nn

    from rlfleet.policygroup import BasePolicy

    width = 1024
    layers = max(1, model_mib * MiB // (width * width * 4))

    class SeedSharedBuffer:
        """The seed's "Shared" buffer: a Ray actor per node holding numpy arrays in the object store."""

        def __init__(self) -> None:
            self.state: dict[str, Any] = {}

        def put(self, state: dict[str, Any]) -> int:
            self.state = state
            return len(state)

        def get(self) -> dict[str, Any]:
            return self.state

    class BenchPolicy(BasePolicy):
        def build_model(self) -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])

        def rollout_step(self, env_ret: Any) -> Any:
            return env_ret

        def bump(self) -> None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)

        # -- the seed's path -------------------------------------------------------------
        def seed_put_local(self, buffer: Any) -> int:
            state = {k: v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}
            return int(ray.get(buffer.put.remote(state), timeout=600))

        def _group_and_rank(self, group_id: str, rank: int) -> tuple[Any, int]:
            """The weight-transfer group and `rank`'s place in it."""
            return self._comm.group(group_id), self._comm.group_ranks()[group_id].index(rank)

        def seed_send(self, group_id: str) -> None:
            group, root = self._group_and_rank(group_id, self._comm.rank)
            by_dtype: dict[Any, list[torch.Tensor]] = {}
            for p in self.model.parameters():
                by_dtype.setdefault(p.dtype, []).append(p)
            works = []
            for tensors in by_dtype.values():
                flat = nn.utils.parameters_to_vector(tensors).detach()
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank = root
                works.append((group.broadcast([flat], opts), flat))
            for work, _ in works:
                work.wait()

        def seed_recv_and_put(self, group_id: str, src_rank: int, buffer: Any) -> int:
            group, root = self._group_and_rank(group_id, src_rank)
            by_dtype: dict[Any, list[tuple[str, torch.Tensor]]] = {}
            for name, p in self.model.named_parameters():
                by_dtype.setdefault(p.dtype, []).append((name, p))
            state: dict[str, Any] = {}
            for dtype, named in by_dtype.items():
                flat = torch.empty(sum(p.numel() for _, p in named), dtype=dtype)
                opts = torch.distributed.BroadcastOptions()
                opts.rootRank = root
                group.broadcast([flat], opts).wait()
                offset = 0
                for name, p in named:
                    state[name] = flat[offset : offset + p.numel()].view_as(p).numpy()
                    offset += p.numel()
            return int(ray.get(buffer.put.remote(state), timeout=600))

        def seed_load(self, buffer: Any) -> int:
            state = ray.get(buffer.get.remote(), timeout=600)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    p.copy_(torch.from_numpy(np.asarray(state[name])))
            return len(state)

    return BenchPolicy, SeedSharedBuffer, layers * width * width * 4


def bench_sync(model_mib: int, reps: int) -> tuple[float, float, float]:
    """(seed s, ours Shared s, ours Double s) medians for one sync to 4 evals on 2 nodes."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlfleet.policygroup import PolicyConfig, PolicyGroup, TrainConfig, WeightBufferConfig

    with contextlib.suppress(FileNotFoundError):
        os.remove("/tmp/ray/ray_current_cluster")
    store = max(512 * MiB, 4 * model_mib * MiB)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": store},
    )
    try:
        cluster.add_node(num_cpus=1, object_store_memory=store)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        BenchPolicy, SeedSharedBuffer, nbytes = make_bench_policy(model_mib)
        log(f"model: {nbytes / MiB:.0f} MiB")
        nodes = sorted(
            (n for n in ray.nodes() if n["Alive"]),
            key=lambda n: not n["Resources"].get("node:__internal_head__"),
        )
        n0, n1 = nodes[0]["NodeID"], nodes[1]["NodeID"]

        def on(node: str) -> dict[str, Any]:
            return {
                "num_cpus": 0,
                "max_concurrency": 8,
                "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False),
            }

        def config(strategy: str, kind: str) -> PolicyConfig:
            return PolicyConfig(
                weight_buffer=WeightBufferConfig(type=kind, buffer_strategy=strategy, bucket_bytes=64 * MiB),
                sync_timeout_s=600.0,
                rpc_timeout_s=600.0,
                group_timeout_s=120.0,
            )

        remote = ray.remote(BenchPolicy)
        cfg = config("Shared", "CPUWeightBuffer")
        trainer = remote.options(**on(n0)).remote(config=cfg, role="train", index=0)
        evals = [
            remote.options(**on(n)).remote(config=cfg, role="eval", index=i)
            for i, n in enumerate((n0, n0, n1, n1))
        ]
        ray.get([a.is_alive.remote() for a in [trainer, *evals]], timeout=600)

        def build(strategy: str, kind: str) -> PolicyGroup:
            group = PolicyGroup([trainer], evals, config(strategy, kind))
            group.init(TrainConfig())
            group.init_placement_info(False)
            group.init_weight_buffer()
            group.init_comm_group("gloo")
            group.sync_weights()  # warm: segments mapped, buffers allocated
            return group

        def time_ours(group: PolicyGroup) -> float:
            times = []
            for _ in range(reps):
                ray.get(trainer.bump.remote(), timeout=600)
                start = time.perf_counter()
                group.sync_weights()
                times.append(time.perf_counter() - start)
                assert group.verify_eval_weight_checksums()
            return statistics.median(times)

        ours_double = time_ours(build("Double", "WeightBuffer"))
        log(f"ours Double: {ours_double:.3f}s")
        shared = build("Shared", "CPUWeightBuffer")
        ours_shared = time_ours(shared)
        log(f"ours Shared: {ours_shared:.3f}s")

        # the seed's path, over the same actors and the same cross-node group; release our
        # buffers first (eval weights go back to private, writable storage)
        [cross] = [s for s in shared._sync.steps if s.transport == "broadcast"]
        shared.shutdown()
        buffers = {n: ray.remote(SeedSharedBuffer).options(**on(n)).remote() for n in (n0, n1)}
        receiver = cross.dst[0]

        def seed_sync() -> float:
            ray.get(trainer.bump.remote(), timeout=600)
            start = time.perf_counter()
            put0 = trainer.seed_put_local.remote(buffers[n0])
            send = trainer.seed_send.remote(cross.group_id)
            put1 = receiver.seed_recv_and_put.remote(cross.group_id, cross.src_rank, buffers[n1])
            ray.get([put0, send, put1], timeout=600)
            loads = [e.seed_load.remote(buffers[n]) for e, n in zip(evals, (n0, n0, n1, n1), strict=True)]
            ray.get(loads, timeout=600)
            return time.perf_counter() - start

        seed_sync()  # warm
        seed = statistics.median(seed_sync() for _ in range(reps))
        sums = ray.get([e.get_weight_checksum.remote() for e in evals], timeout=600)
        assert len(set(sums)) == 1
        assert sums[0] == ray.get(trainer.get_weight_checksum.remote(), timeout=600)
        log(f"seed Shared: {seed:.3f}s")
        return seed, ours_shared, ours_double
    finally:
        ray.shutdown()
        cluster.shutdown()
        with contextlib.suppress(FileNotFoundError):
            os.remove("/tmp/ray/ray_current_cluster")


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__.split("\n\n")[0]).parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    workers = 16
    batches = 10 if args.quick else 40
    claims: dict[str, dict[str, Any]] = {}
    rows: list[tuple[str, str, str, str]] = []
    with contextlib.suppress(FileNotFoundError):
        os.remove("/tmp/ray/ray_current_cluster")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        for name, size in (
            ("rollout_overhead_vs_seed", 256),
            ("rollout_overhead_vs_seed_one_per_worker", 16),
        ):
            seed, ours = bench_rollout(workers, size, batches)
            ratio = seed / ours
            log(f"{name}: batch {size}, seed {seed:.1f} us/request, ours {ours:.1f} us/request")
            claims[name] = claim(ratio, 3.0 if name == "rollout_overhead_vs_seed" else None, "x")
            rows.append((name, f"{seed:.1f} us/req", f"{ours:.1f} us/req", f"{ratio:.2f}x"))
    finally:
        ray.shutdown()
    model_mib = 32 if args.quick else 256
    seed_s, shared_s, double_s = bench_sync(model_mib, 2 if args.quick else 3)
    claims["sync_speedup_vs_seed"] = claim(seed_s / shared_s, None, "x")
    claims["sync_double_speedup_vs_seed"] = claim(seed_s / double_s, None, "x")
    rows.append(
        (
            f"sync {model_mib} MiB, 4 evals, 2 nodes (Shared)",
            f"{seed_s:.3f} s",
            f"{shared_s:.3f} s",
            f"{seed_s / shared_s:.2f}x",
        )
    )
    rows.append(
        (
            f"sync {model_mib} MiB (ours Double vs seed Shared)",
            f"{seed_s:.3f} s",
            f"{double_s:.3f} s",
            f"{seed_s / double_s:.2f}x",
        )
    )
    width = max(len(r[0]) for r in rows)
    print(f"\n{'measured':<{width}}  {'seed':>14}  {'ours':>14}  {'ratio':>8}")
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>14}  {r[2]:>14}  {r[3]:>8}")
    return report(claims, args.json, title="policygroup claims")


if __name__ == "__main__":
    sys.exit(main())
