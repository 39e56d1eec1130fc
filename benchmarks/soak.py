"""Soak: weight-sync cycles and rollout requests on a local Ray cluster while eval workers are
killed at random and come back.

Run: hatch run python benchmarks/soak.py [--quick] [--json PATH] [--seed N]

Setup: a 2-node local Ray cluster (node0: trainer, eval0, eval1, and train1, used in the "Mixed"
phase only | node1: eval2, eval3), so a sync moves weights through node0's shared memory and
across nodes by broadcast (from both trainers, a share each, in the "Mixed" phase). The cycles are
split into phases ("Double", "Shared", "None"; "IPC": "Double" with node0's readers on the CUDA
IPC channel in host mode; "Mixed": "Double" with two trainers, each sending its share of every
version), each a PolicyGroup built over the live actors. Every cycle: one train step, one
`sync_weights` (while a client thread keeps sending rollout requests), one exact check of every
eval policy's weights against the trainer's (checksums and versions). Now and then a random eval
worker (not eval0) is killed with SIGKILL: at a random fault point inside the sync (after its
first received bucket, at staging, at its swap) or by a timer at a random moment of the sync; or
it is armed to fail its commit (its buffer cannot ready the commit, as when a request holds the
serving lock): the sync fails on every rank with a clear error, the previous version stays, and
the next sync, run at once, must go through. Or one of its requests is made to outlast the
rolling update's drain ("slow_request"): that worker keeps serving the previous version,
routable, and the next apply swaps it. Ray restarts it; once it answers again it rejoins the
group (placement, buffers and communication groups rebuilt) and the next sync brings it to the
current version.

In the "Mixed" phase, now and then trainer 1 announces the next version for its share of this
one (a sender a step ahead): no rollout worker may commit that mix; the sync fails cleanly and
the next one goes through.

Trainer faults (every 50 cycles, 8 in `--quick`; `_soak_faults`): the node writer SIGKILLed
publishing into the newest slot ("Shared"), SIGTERM of the trainer mid-sync (other phases); the
group is rebuilt after each.

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
                       a restarted worker is not routed to before it has the current weights;
versions_lost          a node buffer that, after its writer was killed mid-publish, no longer
                       holds the newest version committed before, or a group whose version
                       went backwards across a trainer restart (target 0);
sigterm_leaked_segments segments of a SIGTERMed trainer left once it is gone (target 0);
all_draining_past_a_sync stretches in which every routed worker was draining (no request could
                       be served) for longer than one sync's deadline (target 0).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import _claims
import torch
from _soak_faults import CLEAR_ERRORS, Faults, Hung
from _soak_policy import (
    DRAIN_TIMEOUT_S,
    FAULT_POINTS,
    GROUP_TIMEOUT_S,
    KIND,
    OBS_DIM,
    PHASES,
    PLACES,
    RPC_TIMEOUT_S,
    SYNC_TIMEOUT_S,
    WIRING,
    SoakPolicy,
    log,
)

from rlfleet.policygroup import BatchedData, PolicyConfig, PolicyGroup, TrainConfig, WeightBufferConfig

claim = _claims.claim


class Soak(Faults):
    def __init__(self, args: argparse.Namespace) -> None:
        import ray

        self.ray = ray
        self.args = args
        self.rng = random.Random(args.seed)
        self.cycles = 40 if args.quick else 500
        self.requests = 800 if args.quick else 10_000
        self.kill_every = 8 if args.quick else 20
        self.mixed_every = 4 if args.quick else 10
        self.trainer_fault_every, self.trainer_fault_at = (8, 0) if args.quick else (50, 25)
        self.points = (*FAULT_POINTS, "commit", "slow_request")
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
        self.all_draining: list[float] = []  # how long every routed worker was draining, each time
        self.stop_watch = threading.Event()

    # -- routing watch --------------------------------------------------------------------
    def watch_routing(self) -> None:
        """Sample the group's router: a stretch where every worker is draining (no request can be
        served) must end within one sync's deadline; a failed sync must not leave it so."""
        since: float | None = None
        while not self.stop_watch.wait(0.02):
            group = self.group
            router = None if group is None else group._rollouts.router
            workers = [] if router is None else router.workers
            stuck = bool(workers) and all(router.is_draining(w) for w in workers)  # type: ignore[union-attr]
            now = time.monotonic()
            if stuck and since is None:
                since = now
            elif not stuck and since is not None:
                self.all_draining.append(now - since)
                since = None
        if since is not None:
            self.all_draining.append(time.monotonic() - since)

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
    def config(self, phase: str) -> PolicyConfig:
        strategy, _, cuda_ipc = PHASES[phase]
        return PolicyConfig(
            weight_buffer=WeightBufferConfig(
                type=KIND[strategy], buffer_strategy=strategy, bucket_bytes=4096, cuda_ipc=cuda_ipc
            ),
            rollout_mode="async",
            router_type="least_load",
            sync_timeout_s=SYNC_TIMEOUT_S,
            rpc_timeout_s=RPC_TIMEOUT_S,
            group_timeout_s=GROUP_TIMEOUT_S,
            drain_timeout_s=DRAIN_TIMEOUT_S,
        )

    def start_actors(self) -> None:
        remote = self.ray.remote(SoakPolicy)
        for name, node in PLACES.items():
            self.actors[name] = remote.options(
                num_cpus=0, max_concurrency=16, max_restarts=-1, max_task_retries=0, resources={node: 1}
            ).remote(
                config=self.config("Double"),
                role="train" if name.startswith("train") else "eval",
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
        members = self.group.eval_list
        return {n for n, a in self.actors.items() if n.startswith("eval") and any(a is p for p in members)}

    # -- groups ---------------------------------------------------------------------------
    def build_group(self, phase: str) -> None:
        _, trainers, _ = PHASES[phase]
        evals = [n for n in ("eval0", "eval1", "eval2", "eval3") if self.alive_now(n, wait=5.0)]
        train = [self.actors[t] for t in trainers]
        group = PolicyGroup(train, [self.actors[n] for n in evals], self.config(phase))
        self.uids.append(group.buffer_prefix)

        step = ["init"]

        def wire() -> None:
            group.init(TrainConfig(lr=1e-3))  # fresh optimizers: replicas step alike from here
            if len(train) > 1:  # data-parallel replicas start from trainer 0's weights
                state = self.ray.get(train[0].get_state_dict.remote(), timeout=RPC_TIMEOUT_S)
                self.ray.get([t.load_state_dict.remote(state) for t in train[1:]], timeout=RPC_TIMEOUT_S)
            for n in evals:
                self.actors[n].arm.remote(None)
            for step[0], args in WIRING:
                getattr(group, step[0])(*args)

        try:
            self.bounded(f"build {phase} group over {evals}", 4 * RPC_TIMEOUT_S, wire)
        except Hung:
            log(f"building the {phase} group over {evals} hung at {step[0]}")
            raise
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

    # -- RSS ------------------------------------------------------------------------------
    def rss(self) -> dict[str, int]:
        """Resident set size of the driver and of every actor process, in bytes (Linux /proc)."""
        gc.collect()
        page, out = os.sysconf("SC_PAGE_SIZE"), {}
        for name, pid in {"driver": os.getpid(), **self.pids}.items():
            key = name if name == "driver" else f"{name}:{pid}"
            with contextlib.suppress(OSError), open(f"/proc/{pid}/statm") as f:
                out[key] = int(f.read().split()[1]) * page
        return out

    # -- the run --------------------------------------------------------------------------
    def cycle(self, cycle: int, phase: str) -> None:
        group = self.group
        assert group is not None
        strategy = PHASES[phase][0]
        self.rejoin()
        self.bounded("train", RPC_TIMEOUT_S + 10, group.train, None, seed=cycle)
        timer = self.maybe_kill(cycle)
        mixed = phase == "Mixed" and cycle % self.mixed_every == self.mixed_every // 2
        if mixed:  # trainer 1 announces the next version for its share of this one
            self.ray.get(self.actors["train1"].arm.remote("mixed"), timeout=RPC_TIMEOUT_S)
            self.stats["mixed_injected"] += 1
        trainer_fault = None if mixed else self.trainer_fault_due(cycle, strategy)
        sigterm = self.sigterm_trainer() if trainer_fault == "trainer_sigterm" else None
        start = time.perf_counter()
        try:
            self.bounded("sync_weights", 2 * SYNC_TIMEOUT_S + 3 * RPC_TIMEOUT_S, group.sync_weights)
            self.sync_seconds.append(time.perf_counter() - start)
            self.stats["syncs"] += 1
            if mixed:  # a version made of two senders' different versions went through
                self.stats["mixed_committed"] += 1
                log(f"cycle {cycle}: MIXED VERSIONS COMMITTED")
        except CLEAR_ERRORS as exc:
            what = f"{type(exc).__name__}: {str(exc)[:300]}"
            if trainer_fault is not None:  # the trainer is going: the rebuilt group's sync is the retry
                self.stats["sync_errors_trainer_fault"] += 1
                log(f"cycle {cycle}: sync failed cleanly under a trainer fault: {what}")
            else:
                self.stats["sync_errors_clear"] += 1
                log(f"cycle {cycle}: sync failed cleanly: {what}")
                self.sync_again(cycle)
        finally:
            for t in (timer, sigterm[0] if sigterm else None):
                if t is not None:
                    t.join()
        if sigterm is not None:
            self.after_sigterm(sigterm[1])
        elif trainer_fault == "writer_publish":
            self.kill_writer_mid_publish()
        if trainer_fault is not None:
            self.recover_trainer(phase)
        self.verify(cycle)
        assert self.group is not None
        self.version_floor = self.group.weight_version

    def sync_again(self, cycle: int) -> None:
        """After a sync that failed cleanly the group must stay usable: the next one goes through."""
        group = self.group
        assert group is not None
        try:
            self.bounded("sync_weights again", 2 * SYNC_TIMEOUT_S + 3 * RPC_TIMEOUT_S, group.sync_weights)
            self.stats["syncs_after_a_failed_sync"] += 1
        except CLEAR_ERRORS as exc:  # e.g. a worker this cycle's timer killed: the verify drops it
            what = f"{type(exc).__name__}: {str(exc)[:200]}"
            log(f"cycle {cycle}: the sync after a failed one failed too: {what}")

    def shm_ours(self) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(tuple(self.uids)))

    def run(self) -> dict[str, dict[str, Any]]:
        ray = self.ray
        from ray.cluster_utils import Cluster

        with contextlib.suppress(FileNotFoundError):
            os.remove("/tmp/ray/ray_current_cluster")
        for module in (__name__, SoakPolicy.__module__):  # the actors' class travels with them
            ray.cloudpickle.register_pickle_by_value(sys.modules[module])
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
            watcher = threading.Thread(target=self.watch_routing, daemon=True)
            watcher.start()
            log(f"cluster and actors up in {time.monotonic() - t0:.1f}s")
            t_run = time.monotonic()
            phases = list(PHASES)
            n_phases = len(phases)
            per_phase = [self.cycles // n_phases + (i < self.cycles % n_phases) for i in range(n_phases)]
            warmup = max(5, self.cycles // 10)
            done = 0
            for phase, n in zip(phases, per_phase, strict=True):
                self.build_group(phase)
                self.phase_progress = (0, n)
                self.start_client(round(self.requests * n / self.cycles))
                for i in range(n):
                    self.cycle(done, phase)
                    done += 1
                    self.phase_progress = (i + 1, n)
                    if done == warmup:
                        self.refresh_pids()
                        rss_warm = self.rss()
                    if done % max(1, self.cycles // 10) == 0:
                        log(
                            f"{done}/{self.cycles} cycles ({phase}), {self.stats['requests_answered']} "
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
            self.stop_watch.set()
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
        # train1 idles until the last phase: its growth is its first use, not a leak
        workers = {k: v for k, v in growth.items() if k != "driver" and not k.startswith("train1:")}
        worst = max(workers, key=workers.__getitem__) if workers else "none"
        answered_or_clear = s["requests_answered"] + s["requests_failed_clear"]
        total = answered_or_clear + s["requests_lost"]
        sync_p = sorted(self.sync_seconds)
        if leaked:
            log(f"leaked segments: {leaked}")
        nan = float("nan")
        lower = {"higher_is_better": False}
        checks = s["verifications"]
        out = {
            "hung_calls": claim(len(self.hung), 0, "calls", **lower),
            "leaked_shm_segments": claim(len(leaked), 0, "segments", **lower),
            "sigterm_leaked_segments": claim(s["sigterm_leaked_segments"], 0, "segments", **lower),
            "versions_lost": claim(s["versions_lost"], 0, "versions", **lower),
            "rss_growth_driver_pct": claim(growth.get("driver", nan), 5.0, "%", **lower),
            "rss_growth_workers_pct": claim(
                max(workers.values()) if workers else nan, 5.0, f"% (max, {worst.split(':')[0]})", **lower
            ),
            "verifications_passed": claim(s["verifications_passed"] if checks else nan, checks, "checks"),
            "requests_lost": claim(s["requests_lost"] if total else nan, 0, "requests", **lower),
            "sync_cycles": claim(
                s["syncs"] + s["sync_errors_clear"] + s["sync_errors_trainer_fault"], self.cycles, "cycles"
            ),
            "rollout_requests": claim(total, self.requests, "requests"),
            "requests_answered": claim(s["requests_answered"], None, "requests"),
            "requests_retried": claim(s["requests_retried"], None, "retries (clear, retryable errors)"),
            "requests_failed_clear": claim(s["requests_failed_clear"], None, "requests (after 3 retries)"),
            "requests_served_stale": claim(s["requests_served_stale"], 0, "requests", **lower),
            "all_draining_past_a_sync": claim(
                sum(d > SYNC_TIMEOUT_S for d in self.all_draining), 0, "times every worker drained", **lower
            ),
            "all_draining_max_s": claim(max(self.all_draining, default=0.0), None, "s"),
            "mixed_versions_committed": claim(
                s["mixed_committed"],
                0,
                f"syncs (of {s['mixed_injected']} with senders a version apart)",
                **lower,
            ),
            "eval_kills": claim(s["kills"], None, "kills"),
            "eval_rejoins": claim(s["rejoins"], None, "rejoins"),
            "trainer_faults": claim(
                s["trainer_faults_writer_publish"] + s["trainer_faults_sigterm"],
                None,
                f"faults ({s['trainer_faults_writer_publish']} writer killed mid-publish, "
                f"{s['trainer_faults_sigterm']} SIGTERM holding {s['sigterm_segments_held']} segments), "
                f"{s['trainer_recoveries']} recovered",
            ),
            "sync_errors_clear": claim(
                s["sync_errors_clear"],
                None,
                f"syncs (+{s['sync_errors_trainer_fault']} under a trainer fault)",
            ),
            "syncs_after_a_failed_sync_ok": claim(
                s["syncs_after_a_failed_sync"],
                s["sync_errors_clear"],
                "syncs (each failed sync, then one that goes through)",
            ),
            "sync_p50_s": claim(sync_p[len(sync_p) // 2] if sync_p else nan, None, "s"),
            "sync_max_s": claim(sync_p[-1] if sync_p else nan, None, "s"),
            "run_s": claim(run_s, None, "s"),
        }
        if self.hung:
            log(f"hung: {self.hung}")
        log(
            f"kill points: { {k: v for k, v in s.items() if k.startswith('kills_at_')} }; rss growth {growth}"
        )
        return out


def main(argv: list[str] | None = None) -> int:
    parser = _claims.arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    claims = Soak(args).run()
    return _claims.report(claims, args.json, title="soak")


if __name__ == "__main__":
    sys.exit(main())
