"""The main job: PPO on CartPole-v1 with rlfleet doing the policy-group work.

Env workers (Ray actors, each a vector of CartPole envs) send observations through
`PolicyGroup.rollout_batch` to rollout workers (node-affinity routing by env id); the driver
turns trajectories into advantages and hands each trainer its shard; the trainers run PPO,
data-parallel over gloo; `sync_weights` moves the new weights to every rollout worker after
each update along the `SyncPlan` rlfleet.placement made for the cluster (one line per sync:
what it measured next to what the plan predicted), and `verify_eval_weight_consistency`
checks them every few iterations. The plan that ran is drawn, with its measured time, in
out/demo/sync_plan.png.

Each sync line also says the bytes it moved: what its steps put on the wire beside the full
version's bytes, and which rollout workers got a delta (``--delta auto``, the default: a
broadcast sends only what changed once every receiver holds the version before) or the full
version. On one node every step is the node buffer, which always carries full versions; with
``--nodes 3`` the rollout workers on nodes without a trainer get theirs by broadcast, and those
steps can carry deltas. (PPO's Adam steps change nearly every fp32 weight, so even there most
buckets go full: the line says so rather than counting them as deltas.)

    hatch run demo                       # embedded local Ray, 1 node
    hatch run demo --nodes 3             # a local 3-node Ray cluster
    hatch run demo --address auto        # join a running cluster

Exits 0 once the mean return of the last 20 episodes reaches 195 (CartPole's solved line).
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import cartpole_policy  # beside this script (its folder is on the path when run)
import numpy as np
import ray
import torch
from cartpole_policy import CartPolePolicy, EnvWorker, gae

from rlfleet.policygroup import (
    BatchedData,
    PolicyConfig,
    TrainConfig,
    WeightBufferConfig,
    build_policy_group,
    plan_placement,
    ray_topology,
)

SOLVED = 195.0
BUFFER_TYPE = {
    "None": "WeightBuffer",
    "Double": "WeightBuffer",
    "Shared": "CPUWeightBuffer",
    "Sharded": "ShardedWeightBuffer",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--iterations", type=int, default=150, help="max PPO iterations (stops early when solved)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--router",
        default="node_affinity",
        choices=["node_affinity", "simple", "least_load", "round_robin", "power_of_two", "consistent_hash"],
    )
    p.add_argument("--mode", default="sync", choices=["sync", "async"], help="rollout mode")
    p.add_argument("--strategy", default="Shared", choices=list(BUFFER_TYPE), help="weight buffer strategy")
    p.add_argument(
        "--delta",
        default="auto",
        choices=["auto", "off"],
        help="send a broadcast's version as its difference from the last one (auto) or always full",
    )
    p.add_argument("--num-train", type=int, default=2)
    p.add_argument("--num-eval", type=int, default=4)
    p.add_argument("--nodes", type=int, default=1, help="start a local Ray cluster of this many nodes")
    p.add_argument("--address", default=None, help="join an existing Ray cluster instead")
    p.add_argument("--env-workers", type=int, default=4)
    p.add_argument("--envs-per-worker", type=int, default=2)
    p.add_argument("--steps", type=int, default=64, help="env steps per worker per iteration")
    p.add_argument("--lr", type=float, default=2.5e-3)
    p.add_argument("--verify-every", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("out/demo"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--require-solved",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit non-zero unless solved (--no-require-solved for smoke runs)",
    )
    return p.parse_args(argv)


def require_token_auth() -> None:
    """Keep Ray's token authentication on for the cluster we start, with a private token.

    Ray >= 2.59 turns it on for a local `ray.init()` unless RAY_AUTH_MODE says otherwise; we
    make that explicit, so it holds whatever Ray's default. Ray writes its default token file with
    the process umask (often 0644): create it 0600 ourselves, or tighten an existing one.
    An explicit RAY_AUTH_MODE=disabled, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH is respected.
    """
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"
        try:  # Ray caches its config at import: refresh it, as ray.init does when it turns auth on
            from ray._raylet import Config

            Config.initialize("")
        except (ImportError, AttributeError):  # pragma: no cover - Ray without token auth
            pass
    if os.environ["RAY_AUTH_MODE"] != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    token = Path.home() / ".ray" / "auth_token"
    token.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if token.stat().st_mode & 0o077:
            token.chmod(0o600)
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))


def local_only_ray() -> dict[str, Any]:
    """Keep a single-node Ray on this machine: loopback addresses, private IPC sockets.

    Ray (2.5x on Linux) turns `_node_ip_address="127.0.0.1"` into the machine's address, so that
    other machines could join, and its servers listen there or on every interface. Ray's own
    switch for a machine-local instance is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 (read at import,
    hence the constant too). Ray also makes its session and socket directories world-writable
    (shared by every user of /tmp/ray): root them in a directory only we can enter.
    Returns the extra `ray.init` arguments.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    private = Path(tempfile.gettempdir()) / f"rlfleet-ray-{os.getuid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    st = private.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise SystemExit(f"{private} must be a directory of ours (Ray's sockets live under it)")
    if st.st_mode & 0o077:
        private.chmod(0o700)
    return {"_node_ip_address": "127.0.0.1", "_temp_dir": str(private / "ray")}


@contextmanager
def ray_runtime(args: argparse.Namespace) -> Iterator[list[str]]:
    """Ray for the run: join `--address`, or start a local one (a `Cluster` for `--nodes > 1`).

    A single local node listens on loopback only, keeps its IPC sockets private and has Ray's
    token authentication on.
    Yields the node ids to place on, head first.
    """
    cluster = None
    stale = Path("/tmp/ray/ray_current_cluster")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if args.address:
        ray.init(address=args.address, log_to_driver=False)
    elif args.nodes > 1:
        from ray.cluster_utils import Cluster

        stale.unlink(missing_ok=True)
        # Ray's test Cluster binds the machine's own address (it cannot be pinned to loopback).
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
        for _ in range(args.nodes - 1):
            cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        stale.unlink(missing_ok=True)
        require_token_auth()
        ray.init(
            num_cpus=max(2, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=False,
            **local_only_ray(),
        )
    try:
        ray.cloudpickle.register_pickle_by_value(cartpole_policy)  # workers need not import examples/
        yield list(ray_topology().nodes)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def component_distribution(args: argparse.Namespace, config: PolicyConfig) -> dict[str, Any]:
    """Which env workers and rollout workers share a node (the seed's resource-manager view)."""
    placement = plan_placement(args.num_train, args.num_eval, config)
    evals = [w for w in placement.workers if w.role == "eval"]
    nodes = sorted({w.node for w in evals}, key=[w.node for w in evals].index)
    dist: dict[str, Any] = {n: {"env": {"ids": []}, "eval": {"ids": []}} for n in nodes}
    for i, w in enumerate(evals):
        dist[w.node]["eval"]["ids"].append(i)
    for e in range(args.env_workers):
        dist[nodes[e % len(nodes)]]["env"]["ids"].append(e)
    return dist


class Timings:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.last[name] = time.perf_counter() - start
        self.total[name] += self.last[name]


def collect(group: Any, envs: list[Any], steps: int, returns: list[float]) -> dict[str, np.ndarray]:
    """`steps` env steps on every worker, actions from the rollout workers via rollout_batch."""
    ids = [f"env-{i}" for i in range(len(envs))]
    obs = ray.get([e.observe.remote() for e in envs], timeout=60)
    buf: dict[str, list[np.ndarray]] = defaultdict(list)
    versions: list[int] = []
    for _ in range(steps):
        resp = group.rollout_batch(BatchedData(ids, obs))
        out = ray.get(list(resp.values()), timeout=60)
        results = ray.get([e.step.remote(o["action"]) for e, o in zip(envs, out, strict=True)], timeout=60)
        buf["obs"].append(np.stack(obs))
        for key in ("action", "logp", "value"):
            buf[key].append(np.stack([o[key] for o in out]))
        buf["reward"].append(np.stack([r[1] for r in results]))
        buf["done"].append(np.stack([r[2] for r in results]).astype(np.float32))
        versions.extend(int(o["version"]) for o in out)
        for r in results:
            returns.extend(r[3])
        obs = [r[0] for r in results]
    last = ray.get(list(group.rollout_batch(BatchedData(ids, obs)).values()), timeout=60)
    data = {k: np.stack(v) for k, v in buf.items()}  # [T, workers, envs, ...]
    data["last_value"] = np.stack([o["value"] for o in last])
    data["versions"] = np.asarray(versions)
    return data


def shard(data: dict[str, np.ndarray], parts: int) -> list[dict[str, torch.Tensor]]:
    adv, ret = gae(data["reward"], data["value"], data["done"], data["last_value"], 0.99, 0.95)
    flat = {
        "obs": data["obs"].reshape(-1, data["obs"].shape[-1]),
        "action": data["action"].reshape(-1),
        "logp": data["logp"].reshape(-1),
        "adv": adv.reshape(-1),
        "ret": ret.reshape(-1),
    }
    n = len(flat["action"]) // parts * parts  # equal shards keep the all-reduces paired
    return [{k: torch.as_tensor(v[i:n:parts]) for k, v in flat.items()} for i in range(parts)]


def save_outputs(out: Path, returns: list[float], group: Any, args: argparse.Namespace) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(returns, lw=0.8, alpha=0.5, label="episode return")
    if len(returns) >= 20:
        ax.plot(
            range(19, len(returns)),
            np.convolve(returns, np.ones(20) / 20, mode="valid"),
            label="mean of last 20",
        )
    ax.axhline(SOLVED, color="k", ls="--", lw=0.8, label="solved (195)")
    ax.set_xlabel("episode")
    ax.set_ylabel("return")
    ax.set_title(
        f"PPO on CartPole-v1 via rlfleet ({args.num_train} train, {args.num_eval} eval, {args.strategy})"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png", dpi=110)
    plt.close(fig)
    written.append(out / "reward_curve.png")

    plan, report = group.sync_plan, group.last_sync_report
    if plan is not None:  # the plan the syncs ran, with what the last one measured
        written.append(plan.draw(out / "sync_plan.png", report if report and report.matches(plan) else None))
    return written


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    config = PolicyConfig(
        rollout_mode=args.mode,
        router_type=args.router,
        weight_buffer=WeightBufferConfig(
            type=BUFFER_TYPE[args.strategy], buffer_strategy=args.strategy, delta=args.delta
        ),
    )
    train_config = TrainConfig(lr=args.lr, seed=args.seed, extra={"epochs": 4, "minibatches": 4})
    returns: list[float] = []
    timings = Timings()
    moved = Moved()
    with ray_runtime(args) as nodes:
        if args.router == "node_affinity":
            config.component_distribution = component_distribution(args, config)
        dist = config.component_distribution or {nodes[0]: {"env": {"ids": list(range(args.env_workers))}}}
        env_node = {e: n for n, c in dist.items() for e in c["env"]["ids"]}
        remote_env = ray.remote(num_cpus=0)(EnvWorker)
        envs = [
            remote_env.options(
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    env_node.get(i, nodes[0]), soft=True
                )
            ).remote(args.envs_per_worker, args.seed * 1000 + i)
            for i in range(args.env_workers)
        ]
        with timings("setup"):
            group = build_policy_group(
                CartPolePolicy,
                args.num_train,
                args.num_eval,
                config,
                train_config=train_config,
                policy_kwargs={"seed": args.seed},
            )
        try:
            with timings("sync"):
                report = group.sync_weights()  # rollout workers start from the trainers' initial weights
            plan = group.sync_plan
            if plan is not None and report is not None:
                print(f"sync plan: {plan.name}, {len(plan.steps)} steps, {plan.topology_source}")
                print(delta_note(plan, args.delta))
                print(f"first sync {report.summary()}")
                moved.add(report)
            solved_at = run_loop(args, group, envs, returns, timings, moved)
            print_summary(timings, group, returns, solved_at)
            print(moved.line())
            for path in save_outputs(args.out, returns, group, args):
                print(f"wrote {path}")
        finally:
            group.shutdown()
    if solved_at is None:
        reason = (
            f"not solved: mean return of the last 20 episodes is {np.mean(returns[-20:]):.1f} "
            f"< {SOLVED} after {args.iterations} iterations"
        )
        print(reason, file=sys.stderr)
        return 1 if args.require_solved else 0
    return 0


def run_loop(
    args: argparse.Namespace,
    group: Any,
    envs: list[Any],
    returns: list[float],
    timings: Timings,
    moved: Moved,
) -> int | None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [
        TextColumn("iter {task.completed:>3}/{task.total}"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ]
    env_steps = 0
    start = time.perf_counter()
    with Progress(*columns, disable=args.no_progress) as bar:
        task = bar.add_task("", total=args.iterations)
        for it in range(1, args.iterations + 1):
            with timings("rollout"):
                data = collect(group, envs, args.steps, returns)
            served = set(data["versions"].tolist())
            if served != {group.weight_version}:
                raise RuntimeError(
                    f"iteration {it}: rollouts used versions {served}, expected {group.weight_version}"
                )
            env_steps += data["reward"].size
            with timings("train"):
                shards = shard(data, args.num_train)
                group.update_dataset(shards)
                group.train(seed=args.seed * 100_000 + it)
            with timings("sync"):
                report = group.sync_weights()
            if report is not None:
                print(f"iter {it:>3} sync {report.summary()}")  # above the bar (rich redirects stdout)
                moved.add(report)
            if it % args.verify_every == 0:
                with timings("verify"):
                    if not group.verify_eval_weight_consistency():
                        raise RuntimeError(f"iteration {it}: eval weights differ from the trainers'")
            mean = float(np.mean(returns[-20:])) if returns else 0.0
            rate = env_steps / (time.perf_counter() - start)
            bar.update(
                task,
                advance=1,
                description=(
                    f"return {mean:6.1f} | {rate:7.0f} env steps/s "
                    f"| sync {timings.last['sync'] * 1e3:6.1f} ms | v{group.weight_version}"
                ),
            )
            if len(returns) >= 20 and mean >= SOLVED:
                return it
    return None


def delta_note(plan: Any, delta: str) -> str:
    """Which steps of the plan can send a delta (only a broadcast carries one here)."""
    carriers = [s for s in plan.steps if s.transport == "broadcast"]
    if delta == "off":
        return "deltas: off (--delta off): every sync sends full versions"
    if not carriers:
        return (
            f"deltas: none of the plan's {len(plan.steps)} step(s) can carry one: the node buffer "
            "sends full versions (--nodes 3 adds cross-node broadcasts, which send deltas)"
        )
    return (
        f"deltas: {len(carriers)} broadcast step(s) of {len(plan.steps)} send only what changed once "
        "every receiver holds the version before; node-buffer steps send full versions"
    )


class Moved:
    """The bytes every sync put on the wire, beside the bytes of full versions."""

    def __init__(self) -> None:
        self.syncs = self.sent = self.full = self.deltas = 0

    def add(self, report: Any) -> None:
        if report.bytes_on_wire is None:
            return
        self.syncs += 1
        self.sent += report.bytes_on_wire
        self.full += report.full_bytes or report.bytes_on_wire
        self.deltas += bool(report.delta_receivers)

    def line(self) -> str:
        if not self.syncs:
            return "bytes moved: not reported"
        per = self.sent / self.syncs / 1e3
        return (
            f"bytes moved: {self.sent / 1e6:.3f} MB in {self.syncs} syncs ({per:.1f} KB per sync), "
            f"full versions {self.full / 1e6:.3f} MB; {self.deltas} sync(s) sent a delta"
        )


def print_summary(timings: Timings, group: Any, returns: list[float], solved_at: int | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="time by phase")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    for name in ("setup", "rollout", "train", "sync", "verify"):
        table.add_row(name, f"{timings.total.get(name, 0.0):.2f}")
    console = Console()
    console.print(table)
    status = f"solved at iteration {solved_at}" if solved_at else "not solved"
    console.print(
        f"{status}; episodes {len(returns)}; mean of last 20 {np.mean(returns[-20:]):.1f}; "
        f"weight version {group.weight_version}; eval versions {group.eval_weight_versions()}"
    )


if __name__ == "__main__":
    sys.exit(main())
