"""Soak: weight-sync cycles and rollout requests on a local Ray cluster while eval workers are
killed at random and come back.

Run: hatch run python benchmarks/soak.py [--quick] [--json PATH] [--seed N]

Setup: a 2-node local Ray cluster (node0: trainer, eval0, eval1 | node1: eval2, eval3), so a
sync moves weights through node0's shared memory and across nodes by broadcast. The cycles are
split into phases, one per buffer strategy ("Double", "Shared", "None"), each a PolicyGroup
built over the live actors. Every cycle: one train step, one `sync_weights` (while a client
thread keeps sending rollout requests), one exact check of every eval policy's weights against
the trainer's (checksums and versions). Now and then a random eval worker (not eval0) is killed
with SIGKILL: at a random fault point inside the sync (after its first received bucket, at
staging, at its swap) or by a timer at a random moment of the sync. Ray restarts it; once it
answers again it rejoins the group (placement, buffers and communication groups rebuilt) and
the next sync brings it to the current version.

Checked (the claims):
hung_calls             every group call and every request has a deadline; calls that hit it
                       without a clear error (target 0);
leaked_shm_segments    /dev/shm segments of this run's groups left after shutdown (target 0);
rss_growth_driver_pct  driver RSS growth from the end of warm-up to the end (target < 5%);
rss_growth_workers_pct the largest RSS growth of a worker alive through the whole run (the
                       trainer, eval0, and any eval never killed) (target < 5%);
verifications_passed   exact weight checks that passed, out of all (target: all);
requests_lost          requests neither answered nor failed with a clear error the caller may
                       retry (target 0); a request is retried up to 3 times;
requests_served_stale  requests answered with weights older than the version every eval policy
                       of the group had been verified at when the request was sent (target 0):
                       a restarted worker is not routed to before it has the current weights.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import json
import os
import random
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rlfleet.policygroup import (
    BasePolicy,
    BatchedData,
    PolicyConfig,
    PolicyGroup,
    PolicyGroupError,
    TrainConfig,
    WeightBufferConfig,
)
from rlfleet.weightsync import WeightSyncError

OBS_DIM = 8
SYNC_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 20.0
GROUP_TIMEOUT_S = 10.0
KIND = {"None": "WeightBuffer", "Double": "WeightBuffer", "Shared": "CPUWeightBuffer"}
PLACES = {"train0": "node0", "eval0": "node0", "eval1": "node0", "eval2": "node1", "eval3": "node1"}
KILLABLE = ("eval1", "eval2", "eval3")
FAULT_POINTS = ("consume", "stage", "apply", "timer")


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def claim(value: float, target: float | None, unit: str, ok: bool | None = None) -> dict[str, Any]:
    return {
        "value": round(value, 4) if isinstance(value, float) else value,
        "target": target,
        "unit": unit,
        "ok": True if ok is None else bool(ok),
    }


# ------------------------------------------------------------------ the policy (pickled by value)
class SoakPolicy(BasePolicy):
    """A small MLP; `arm(point)` makes it SIGKILL itself the next time it reaches `point`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._armed: str | None = None
        super().__init__(*args, **kwargs)

    def build_model(self) -> nn.Module:
        torch.manual_seed(1234)
        return nn.Sequential(
            nn.Linear(OBS_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
        )

    def rollout_step(self, env_ret: Any) -> dict[str, Any]:
        logits = self.model(torch.as_tensor(env_ret, dtype=torch.float32)[None])[0]
        return {"logits": logits.tolist(), "version": self.get_weight_version(), "worker": self.index}

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        assert self.optimizer is not None
        g = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        x, y = torch.randn(16, OBS_DIM, generator=g), torch.randn(16, 4, generator=g)
        self.optimizer.zero_grad()
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach())}

    def get_pid(self) -> int:
        return os.getpid()

    def arm(self, point: str | None) -> None:
        self._armed = point

    def _maybe_die(self, point: str) -> None:
        if self._armed == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def _hook(self) -> None:
        if self._armed != "consume":
            return
        for consumer in self._weights.consumers():
            if "consume" not in vars(consumer):
                original = consumer.consume

                def consume(index: int, data: torch.Tensor, original: Any = original) -> None:
                    original(index, data)
                    self._maybe_die("consume")

                consumer.consume = consume  # type: ignore[method-assign]

    def stage_from_segment(self, name: str, version: int, *deps: Any) -> int:
        self._maybe_die("stage")
        self._hook()
        return super().stage_from_segment(name, version, *deps)

    def recv_broadcast(self, group_id: str, src_rank: int, version: int, timeout_s: float) -> int:
        self._maybe_die("stage")
        self._hook()
        return super().recv_broadcast(group_id, src_rank, version, timeout_s)

    def apply_staged(self, version: int | None = None, timeout_s: float | None = None) -> int:
        self._maybe_die("apply")
        return super().apply_staged(version, timeout_s)


# ------------------------------------------------------------------ bookkeeping
def rss_of(pid: int) -> int:
    """Resident set size of a process on this machine, in bytes (Linux /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Hung(Exception):
    """A call passed its deadline without raising a clear error."""


CLEAR_ERRORS: tuple[type[BaseException], ...] = (PolicyGroupError, WeightSyncError)


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        self.ray = ray
        self.args = args
        self.rng = random.Random(args.seed)
        self.cycles = 40 if args.quick else 500
        self.requests = 800 if args.quick else 10_000
        self.kill_every = 8 if args.quick else 20
        self.pool = concurrent.futures.ThreadPoolExecutor(4)
        self.stats: Counter[str] = Counter()
        self.hung: list[str] = []
        self.sync_seconds: list[float] = []
        self.uids: list[str] = []
        self.actors: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.probes: dict[str, Any] = {}
        self.phase_progress = (0, 1)  # (cycles done, cycles) of the current phase
        self.group: PolicyGroup | None = None
        self.version_floor = 0
        self.stop_client = threading.Event()
        self.client: threading.Thread | None = None
        self.client_error: BaseException | None = None
        self.issued = 0
        self.lock = threading.Lock()

    # -- bounded calls ------------------------------------------------------------------
    def bounded(self, what: str, seconds: float, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run `fn` with a hard deadline; a call that passes it is a hung call (the soak stops)."""
        future = self.pool.submit(fn, *args, **kwargs)
        try:
            return future.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            self.hung.append(f"{what} (> {seconds:.0f}s)")
            raise Hung(what) from None

    # -- cluster and actors ---------------------------------------------------------------
    def config(self, strategy: str) -> PolicyConfig:
        return PolicyConfig(
            weight_buffer=WeightBufferConfig(
                type=KIND[strategy], buffer_strategy=strategy, bucket_bytes=4096
            ),
            rollout_mode="async",
            router_type="least_load",
            sync_timeout_s=SYNC_TIMEOUT_S,
            rpc_timeout_s=RPC_TIMEOUT_S,
            group_timeout_s=GROUP_TIMEOUT_S,
            drain_timeout_s=10.0,
        )

    def start_actors(self) -> None:
        remote = self.ray.remote(SoakPolicy)
        for name, node in PLACES.items():
            self.actors[name] = remote.options(
                num_cpus=0, max_concurrency=16, max_restarts=-1, max_task_retries=0, resources={node: 1}
            ).remote(
                config=self.config("Double"),
                role="train" if name == "train0" else "eval",
                index=int(name[-1]),
            )
        self.ray.get([a.is_alive.remote() for a in self.actors.values()], timeout=300)
        self.refresh_pids()

    def refresh_pids(self) -> None:
        for name, actor in self.actors.items():
            with contextlib.suppress(Exception):
                self.pids[name] = self.ray.get(actor.get_pid.remote(), timeout=5)

    def alive_now(self, name: str, wait: float = 0.0) -> bool:
        """Whether the actor answers; a probe still queued (actor restarting) is kept for later."""
        ref = self.probes.pop(name, None) or self.actors[name].is_alive.remote()
        ready, _ = self.ray.wait([ref], timeout=wait)
        if not ready:
            self.probes[name] = ref
            return False
        try:
            return bool(self.ray.get(ref, timeout=1))
        except Exception:
            return False

    def names_in_group(self) -> set[str]:
        assert self.group is not None
        wid = self.group._roster.wid
        wids = {wid(p) for p in self.group.eval_list}
        return {n for n, a in self.actors.items() if n != "train0" and wid(a) in wids}

    # -- groups ---------------------------------------------------------------------------
    def build_group(self, strategy: str) -> None:
        evals = [n for n in ("eval0", "eval1", "eval2", "eval3") if self.alive_now(n, wait=5.0)]
        group = PolicyGroup([self.actors["train0"]], [self.actors[n] for n in evals], self.config(strategy))
        self.uids.append(f"rlfleet-{group._uid}")

        def wire() -> None:
            group.init(TrainConfig(lr=1e-3))
            for n in evals:
                self.actors[n].arm.remote(None)
            group.init_placement_info()
            group.init_weight_buffer()
            group.init_comm_group("gloo")
            group.sync_weights()

        self.bounded(f"build {strategy} group", 4 * RPC_TIMEOUT_S, wire)
        self.group = group
        self.version_floor = group.weight_version

    def rejoin(self) -> None:
        """Bring restarted eval workers back into the group."""
        assert self.group is not None
        group = self.group
        back = [
            n for n in ("eval1", "eval2", "eval3") if n not in self.names_in_group() and self.alive_now(n)
        ]
        if not back:
            return

        def wire() -> None:
            for n in back:
                self.actors[n].arm.remote(None)
                group.push(self.actors[n], "eval")
            group.init_eval()
            group.init_placement_info()
            group.init_weight_buffer()
            group.init_comm_group("gloo")

        try:
            self.bounded("rejoin", 4 * RPC_TIMEOUT_S, wire)
            self.stats["rejoins"] += len(back)
            self.refresh_pids()
        except (*CLEAR_ERRORS, self.ray.exceptions.RayError) as exc:
            self.stats["rejoin_errors_clear"] += 1
            log(f"rejoin failed cleanly ({type(exc).__name__}: {str(exc)[:200]}); retried later")
            with contextlib.suppress(Exception):
                group.check_liveness()

    # -- rollout client -------------------------------------------------------------------
    def client_loop(self, quota: int) -> None:
        """Send `quota` requests in batches of 10; each answered or failed clearly, else lost."""
        rng = random.Random(self.args.seed + 1)
        sent = 0
        try:
            while sent < quota and not self.stop_client.is_set():
                done, cycles = self.phase_progress
                if sent >= quota * (done + 1) / cycles:  # spread the requests over the phase's syncs
                    time.sleep(0.005)
                    continue
                n = min(10, quota - sent)
                pending = {f"env-{self.issued + i}": 0 for i in range(n)}
                sent += n
                with self.lock:
                    self.issued += n
                while pending:
                    ids = list(pending)
                    x = torch.randn(
                        len(ids), OBS_DIM, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))
                    )
                    group = self.group
                    assert group is not None
                    floor = self.version_floor  # every eval policy in the group serves at least this
                    try:
                        resp = self.bounded(
                            "rollout_batch",
                            RPC_TIMEOUT_S + 10,
                            group.rollout_batch,
                            BatchedData(ids, x.tolist()),
                        )
                        refs = resp.values()
                    except CLEAR_ERRORS as exc:
                        refs = [exc] * len(ids)
                    for rid, ref in zip(ids, refs, strict=True):
                        outcome = self.collect(ref, floor)
                        if outcome == "answered":
                            del pending[rid]
                            continue
                        if outcome == "lost":
                            self.stats["requests_lost"] += 1
                            del pending[rid]
                            continue
                        pending[rid] += 1  # clear, retryable error
                        self.stats["requests_retried"] += 1
                        if pending[rid] > 3:
                            self.stats["requests_failed_clear"] += 1
                            del pending[rid]
        except Hung:
            self.stats["requests_lost"] += len(pending)
        except BaseException as exc:  # pragma: no cover - reported as a soak failure
            self.client_error = exc

    def collect(self, ref: Any, floor: int) -> str:
        ray = self.ray
        if isinstance(ref, BaseException):
            return "retry"
        try:
            value = ray.get(ref, timeout=RPC_TIMEOUT_S + 10)
        except ray.exceptions.GetTimeoutError:
            self.hung.append("rollout request (no answer, no error)")
            return "lost"
        except (ray.exceptions.RayActorError, *CLEAR_ERRORS):
            return "retry"
        except ray.exceptions.RayTaskError as exc:
            if isinstance(getattr(exc, "cause", None), CLEAR_ERRORS):  # e.g. a restarted worker refused it
                return "retry"
            self.stats["requests_task_error"] += 1
            log(f"request failed inside the policy: {str(exc)[:200]}")
            return "lost"
        ok = isinstance(value, dict) and len(value.get("logits", ())) == 4
        if not ok:
            return "lost"
        self.stats["requests_answered"] += 1
        if value["version"] < floor:  # older than what the group had verified when it was sent
            self.stats["requests_served_stale"] += 1
            if self.stats["requests_served_stale"] <= 5:
                log(f"stale answer: eval {value['worker']} at v{value['version']}, sent at v{floor}")
        return "answered"

    def start_client(self, quota: int) -> None:
        self.stop_client.clear()
        self.client = threading.Thread(target=self.client_loop, args=(quota,), daemon=True)
        self.client.start()

    def join_client(self, finish: bool) -> None:
        if self.client is None:
            return
        if not finish:
            self.stop_client.set()
        self.client.join(600)
        if self.client.is_alive():
            self.hung.append("rollout client thread")
        self.client = None

    # -- faults ---------------------------------------------------------------------------
    def maybe_kill(self, cycle: int) -> threading.Timer | None:
        if cycle % self.kill_every != self.kill_every // 2:
            return None
        members = self.names_in_group()
        candidates = [n for n in KILLABLE if n in members]
        if len(members) < 3 or not candidates:
            return None
        victim = self.rng.choice(candidates)
        point = self.rng.choice(FAULT_POINTS)
        self.stats["kills"] += 1
        self.stats[f"kills_at_{point}"] += 1
        if point != "timer":
            self.actors[victim].arm.remote(point)
            return None
        pid = self.pids.get(victim)
        if pid is None:
            return None
        timer = threading.Timer(self.rng.uniform(0.0, 0.3), lambda: os.kill(pid, signal.SIGKILL))
        timer.start()
        return timer

    # -- RSS ------------------------------------------------------------------------------
    def rss(self) -> dict[str, int]:
        gc.collect()
        out = {"driver": rss_of(os.getpid())}
        for name, pid in self.pids.items():
            with contextlib.suppress(OSError):
                out[f"{name}:{pid}"] = rss_of(pid)
        return out

    # -- the run --------------------------------------------------------------------------
    def cycle(self, cycle: int) -> None:
        group = self.group
        assert group is not None
        self.rejoin()
        self.bounded("train", RPC_TIMEOUT_S + 10, group.train, None, seed=cycle)
        timer = self.maybe_kill(cycle)
        start = time.perf_counter()
        try:
            self.bounded("sync_weights", 2 * SYNC_TIMEOUT_S + 3 * RPC_TIMEOUT_S, group.sync_weights)
            self.sync_seconds.append(time.perf_counter() - start)
            self.stats["syncs"] += 1
        except CLEAR_ERRORS as exc:
            self.stats["sync_errors_clear"] += 1
            log(f"cycle {cycle}: sync failed cleanly: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            if timer is not None:
                timer.join()
        self.verify(cycle)
        self.version_floor = group.weight_version

    def verify(self, cycle: int) -> None:
        group = self.group
        assert group is not None
        for _ in range(3):
            try:
                ok = self.bounded("verify", 2 * RPC_TIMEOUT_S, self._verify_once, group)
            except CLEAR_ERRORS:  # a worker died after the sync (timer kill): drop it, check the rest
                self.bounded("check_liveness", RPC_TIMEOUT_S, group.check_liveness)
                continue
            self.stats["verifications"] += 1
            self.stats["verifications_passed"] += int(ok)
            if not ok:
                log(f"cycle {cycle}: VERIFICATION FAILED")
            return
        self.stats["verifications"] += 1
        log(f"cycle {cycle}: verification could not run")

    @staticmethod
    def _verify_once(group: PolicyGroup) -> bool:
        versions = group.eval_weight_versions()
        return bool(
            group.verify_eval_weight_checksums() and versions == [group.weight_version] * len(versions)
        )

    def shm_ours(self) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(tuple(self.uids)))

    def run(self) -> dict[str, dict[str, Any]]:
        ray = self.ray
        from ray.cluster_utils import Cluster

        with contextlib.suppress(FileNotFoundError):
            os.remove("/tmp/ray/ray_current_cluster")
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        t0 = time.monotonic()
        for attempt in (1, 2):  # Ray gives a raylet 30 s to register: a loaded machine can miss it
            cluster = Cluster(
                initialize_head=True,
                head_node_args={"num_cpus": 1, "include_dashboard": False, "resources": {"node0": 100}},
            )
            try:
                cluster.add_node(num_cpus=1, resources={"node1": 100})
                cluster.wait_for_nodes()
                break
            except Exception:
                cluster.shutdown()
                if attempt == 2:
                    raise
        rss_warm: dict[str, int] = {}
        rss_end: dict[str, int] = {}
        try:
            ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
            self.start_actors()
            log(f"cluster and actors up in {time.monotonic() - t0:.1f}s")
            t_run = time.monotonic()
            phases = ["Double", "Shared", "None"]
            per_phase = [self.cycles // 3 + (i < self.cycles % 3) for i in range(3)]
            warmup = max(5, self.cycles // 10)
            done = 0
            for strategy, n in zip(phases, per_phase, strict=True):
                self.build_group(strategy)
                self.phase_progress = (0, n)
                self.start_client(round(self.requests * n / self.cycles))
                for i in range(n):
                    self.cycle(done)
                    done += 1
                    self.phase_progress = (i + 1, n)
                    if done == warmup:
                        self.refresh_pids()
                        rss_warm = self.rss()
                    if done % max(1, self.cycles // 10) == 0:
                        log(
                            f"{done}/{self.cycles} cycles ({strategy}), {self.stats['requests_answered']} "
                            f"answered, {self.stats['kills']} kills, {self.stats['rejoins']} rejoins"
                        )
                self.join_client(finish=True)
                if done == self.cycles:
                    rss_end = self.rss()
                assert self.group is not None
                self.bounded("shutdown", 60, self.group.shutdown)
            run_s = time.monotonic() - t_run
        except Hung as exc:
            log(f"HUNG: {exc}; stopping")
            run_s = time.monotonic() - t0
        finally:
            self.join_client(finish=False)
            for actor in self.actors.values():
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)
            time.sleep(2.0)
            leaked = self.shm_ours()
            with contextlib.suppress(Exception):
                ray.shutdown()
            cluster.shutdown()
            with contextlib.suppress(FileNotFoundError):
                os.remove("/tmp/ray/ray_current_cluster")
        if self.client_error is not None:
            raise self.client_error
        return self.claims(rss_warm, rss_end, leaked, run_s)

    def claims(
        self, warm: dict[str, int], end: dict[str, int], leaked: list[str], run_s: float
    ) -> dict[str, dict[str, Any]]:
        s = self.stats
        both = [k for k in warm if k in end]
        growth = {k: 100.0 * (end[k] - warm[k]) / warm[k] for k in both}
        workers = {k: v for k, v in growth.items() if k != "driver"}
        worst = max(workers, key=workers.__getitem__) if workers else "none"
        answered_or_clear = s["requests_answered"] + s["requests_failed_clear"]
        total = answered_or_clear + s["requests_lost"]
        sync_p = sorted(self.sync_seconds)
        if leaked:
            log(f"leaked segments: {leaked}")
        out = {
            "hung_calls": claim(len(self.hung), 0, "calls", ok=not self.hung),
            "leaked_shm_segments": claim(len(leaked), 0, "segments", ok=not leaked),
            "rss_growth_driver_pct": claim(
                growth.get("driver", float("nan")), 5.0, "%", ok=growth.get("driver", 99) < 5
            ),
            "rss_growth_workers_pct": claim(
                workers.get(worst, float("nan")),
                5.0,
                f"% (max, {worst.split(':')[0]})",
                ok=bool(workers) and max(workers.values()) < 5,
            ),
            "verifications_passed": claim(
                s["verifications_passed"],
                s["verifications"],
                "checks",
                ok=s["verifications"] > 0 and s["verifications_passed"] == s["verifications"],
            ),
            "requests_lost": claim(
                s["requests_lost"], 0, "requests", ok=s["requests_lost"] == 0 and total > 0
            ),
            "sync_cycles": claim(
                s["syncs"] + s["sync_errors_clear"],
                self.cycles,
                "cycles",
                ok=s["syncs"] + s["sync_errors_clear"] == self.cycles,
            ),
            "rollout_requests": claim(total, self.requests, "requests", ok=total == self.requests),
            "requests_answered": claim(s["requests_answered"], None, "requests"),
            "requests_retried": claim(s["requests_retried"], None, "retries (clear, retryable errors)"),
            "requests_failed_clear": claim(s["requests_failed_clear"], None, "requests (after 3 retries)"),
            "requests_served_stale": claim(
                s["requests_served_stale"], 0, "requests", ok=s["requests_served_stale"] == 0
            ),
            "eval_kills": claim(s["kills"], None, "kills"),
            "eval_rejoins": claim(s["rejoins"], None, "rejoins"),
            "sync_errors_clear": claim(s["sync_errors_clear"], None, "syncs"),
            "sync_p50_s": claim(sync_p[len(sync_p) // 2] if sync_p else float("nan"), None, "s"),
            "sync_max_s": claim(sync_p[-1] if sync_p else float("nan"), None, "s"),
            "run_s": claim(run_s, None, "s"),
        }
        if self.hung:
            log(f"hung: {self.hung}")
        log(
            f"kill points: { {k: v for k, v in s.items() if k.startswith('kills_at_')} }; rss growth {growth}"
        )
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (40 cycles, 800 requests)")
    parser.add_argument("--json", help="write the claims here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    claims = Soak(args).run()
    width = max(len(k) for k in claims)
    print(f"\n{'claim':<{width}}  {'value':>12}  {'target':>10}  ok   unit")
    for name, c in claims.items():
        value = f"{c['value']:.3g}" if isinstance(c["value"], float) else str(c["value"])
        target = "" if c["target"] is None else str(c["target"])
        print(f"{name:<{width}}  {value:>12}  {target:>10}  {'yes' if c['ok'] else 'NO':<4} {c['unit']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(claims, f, indent=2)
    return 0 if all(c["ok"] for c in claims.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
