"""GRPO on a tiny transformer, with an FSDP2 trainer and rollout policies wired by rlfleet.

The task is verifiable: reverse a string of digits (reward: the fraction of positions right;
chance is 0.1). Each iteration the driver draws prompts and sends them through
`PolicyGroup.rollout_batch` to the rollout policies, which sample a group of answers per
prompt; it scores the answers and computes group-relative advantages (GRPO); the two trainers
(torch FSDP2 ``fully_shard`` on their own 2-rank gloo world) each take half of the prompt
groups; then the new weights move to the rollout policies through rlfleet: every trainer rank
gathers one parameter at a time and the node buffer's writer packs them into rlfleet's shared
buffer bucket by bucket (no full copy on any trainer), and ``sync_weights`` swaps the rollout
policies onto that version, zero-copy.

    hatch run grpo                 # until the mean reward reaches 0.9 (exit 0), or the budget ends (1)
    hatch run grpo --quick         # CI: a few iterations; checks the pipeline, not the reward

Writes out/grpo/reward_curve.csv and out/grpo/reward_curve.png.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny_lm
from cartpole_rl import local_only_ray, require_token_auth
from tiny_lm.policy import GRPOPolicy
from tiny_lm.task import group_advantages, make_prompts, rewards

from rlfleet.policygroup import BatchedData, PolicyConfig, TrainConfig, WeightBufferConfig, build_policy_group


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a few iterations: the pipeline, not the reward")
    p.add_argument("--iterations", type=int, default=150, help="iteration budget (stops early at --target)")
    p.add_argument("--max-seconds", type=float, default=600.0, help="wall-time budget of the training loop")
    p.add_argument("--target", type=float, default=0.9, help="mean reward to reach")
    p.add_argument("--window", type=int, default=3, help="iterations the mean reward is averaged over")
    p.add_argument("--length", type=int, default=8, help="digits to reverse")
    p.add_argument("--prompts", type=int, default=32, help="prompts per iteration")
    p.add_argument("--group", type=int, default=8, help="answers sampled per prompt (the GRPO group)")
    p.add_argument("--requests", type=int, default=4, help="rollout requests per iteration")
    p.add_argument("--num-eval", type=int, default=2, help="rollout policies")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--epochs", type=int, default=2, help="optimizer steps per batch")
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("out/grpo"))
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations = min(args.iterations, 3)
    if args.prompts % (2 * args.requests):
        p.error("--prompts must be a multiple of 2 * --requests (two trainers, equal requests)")
    return args


@contextmanager
def local_ray() -> Iterator[None]:
    """An embedded Ray on this machine: loopback only, private sockets, token authentication."""
    Path("/tmp/ray/ray_current_cluster").unlink(missing_ok=True)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    require_token_auth()
    cpus = max(2, os.cpu_count() or 2)
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, **local_only_ray())
    try:
        ray.cloudpickle.register_pickle_by_value(tiny_lm)  # actors need not import examples/
        yield
    finally:
        ray.shutdown()


def build_group(args: argparse.Namespace) -> Any:
    """Two FSDP2 trainers and the rollout policies, on one node, weights through a shared buffer."""
    config = PolicyConfig(
        rollout_mode="sync",
        router_type="least_load",
        weight_buffer=WeightBufferConfig(
            type="CPUWeightBuffer", buffer_strategy="Shared", bucket_bytes=1 << 20
        ),
    )
    train_config = TrainConfig(lr=args.lr, seed=args.seed, extra={"epochs": args.epochs, "clip": args.clip})
    group = build_policy_group(
        GRPOPolicy,
        2,
        args.num_eval,
        config,
        train_config=train_config,
        policy_kwargs={"seed": args.seed, "length": args.length},
        init=False,  # the trainers form their own FSDP2 world: no policy-group communication groups
    )
    try:
        group.init(train_config)
        group.init_placement_info()
        group.init_weight_buffer()
        trainers = group.train_list
        port = ray.get(trainers[0].fsdp_host.remote(), timeout=60)
        sharded = ray.get([t.init_fsdp.remote(r, 2, port) for r, t in enumerate(trainers)], timeout=120)
        if not all(sharded):
            raise RuntimeError("the trainers' parameters are not FSDP2-sharded")
    except BaseException:
        group.shutdown()
        raise
    return group


def sync(group: Any, timeout_s: float = 120.0) -> float:
    """Stream the trainers' new weights into the node buffer, then swap the rollout policies."""
    start = time.perf_counter()
    version = group.weight_version + 1
    ray.get([t.export_weights.remote(version, timeout_s) for t in group.train_list], timeout=timeout_s)
    group.sync_weights()
    if group.weight_version != version or set(group.eval_weight_versions()) != {version}:
        raise RuntimeError(f"sync of version {version}: rollout policies hold {group.eval_weight_versions()}")
    return time.perf_counter() - start


def rollout(
    group: Any, args: argparse.Namespace, generator: torch.Generator, it: int
) -> dict[str, torch.Tensor]:
    """Prompts out through `rollout_batch`, answers back; every answer from the current version."""
    prompts = make_prompts(args.prompts, args.length, generator)
    chunks = prompts.chunk(args.requests)
    ids = [f"prompts-{i}" for i in range(args.requests)]
    requests = [
        {"prompts": c.numpy(), "group": args.group, "seed": args.seed * 1_000_003 + it * 97 + i}
        for i, c in enumerate(chunks)
    ]
    out = ray.get(list(group.rollout_batch(BatchedData(ids, requests)).values()), timeout=120)
    served = {int(o["version"]) for o in out}
    if served != {group.weight_version}:
        raise RuntimeError(
            f"iteration {it}: rollouts used versions {served}, expected {group.weight_version}"
        )
    answers = torch.cat([torch.as_tensor(o["answers"]) for o in out])
    repeated = prompts.repeat_interleave(args.group, 0)
    return {"prompts": repeated, "answers": answers, "reward": rewards(repeated, answers)}


def shards(batch: dict[str, torch.Tensor], group: int, parts: int) -> list[dict[str, np.ndarray]]:
    """Whole prompt groups per trainer, equal sizes (FSDP2's collectives pair up step by step)."""
    sequences = torch.cat([batch["prompts"], batch["answers"]], dim=1)
    advantages = group_advantages(batch["reward"], group)
    per = len(sequences) // parts
    return [
        {"sequences": sequences[s].numpy(), "advantages": advantages[s].numpy()}
        for s in (slice(i * per, (i + 1) * per) for i in range(parts))
    ]


def verify(group: Any) -> None:
    """The rollout policies' weights are the trainers' full weights, bit for bit."""
    trainer = ray.get([t.weights_checksum.remote() for t in group.train_list], timeout=120)
    served = ray.get([p.get_weight_checksum.remote() for p in group.eval_list], timeout=120)
    if len(set(trainer)) != 1 or set(served) != set(trainer):
        raise RuntimeError(f"weights differ: trainers {trainer}, rollout policies {served}")


def train_loop(group: Any, args: argparse.Namespace, history: list[dict[str, float]]) -> int | None:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    generator = torch.Generator().manual_seed(args.seed)
    columns = [
        TextColumn("iter {task.completed:>3}/{task.total}"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ]
    start = time.perf_counter()
    with Progress(*columns, disable=args.no_progress) as bar:
        task = bar.add_task("", total=args.iterations)
        for it in range(1, args.iterations + 1):
            t0 = time.perf_counter()
            batch = rollout(group, args, generator, it)
            t1 = time.perf_counter()
            group.update_dataset(shards(batch, args.group, len(group.train_list)))
            stats = group.train()
            t2 = time.perf_counter()
            sync_s = sync(group)
            reward = float(batch["reward"].mean())
            history.append(
                {
                    "iteration": it,
                    "seconds": time.perf_counter() - start,
                    "mean_reward": reward,
                    "exact": float((batch["reward"] == 1).float().mean()),
                    "loss": stats["loss"],
                    "rollout_s": t1 - t0,
                    "train_s": t2 - t1,
                    "sync_s": sync_s,
                    "version": group.weight_version,
                }
            )
            recent = float(np.mean([h["mean_reward"] for h in history[-args.window :]]))
            bar.update(
                task,
                advance=1,
                description=f"reward {reward:.3f} (last {args.window}: {recent:.3f}) "
                f"| sync {sync_s * 1e3:4.0f} ms | v{group.weight_version}",
            )
            if not args.quick and len(history) >= args.window and recent >= args.target:
                return it
            if time.perf_counter() - start > args.max_seconds:
                return None
    return None


def save(out: Path, history: list[dict[str, float]], args: argparse.Namespace) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "reward_curve.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(history[0]) if history else ["iteration"])
        writer.writeheader()
        writer.writerows(history)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([h["iteration"] for h in history], [h["mean_reward"] for h in history], label="mean reward")
    ax.plot([h["iteration"] for h in history], [h["exact"] for h in history], lw=0.8, label="exactly right")
    ax.axhline(args.target, color="k", ls="--", lw=0.8, label=f"target ({args.target})")
    ax.axhline(0.1, color="grey", ls=":", lw=0.8, label="chance (0.1)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.02)
    ax.set_title(
        f"GRPO, reverse {args.length} digits: FSDP2 trainer (2 ranks) -> rlfleet -> "
        f"{args.num_eval} rollout policies",
        fontsize=10,
    )
    ax.legend(loc="lower right")
    fig.tight_layout()
    png_path = out / "reward_curve.png"
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return [csv_path, png_path]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    history: list[dict[str, float]] = []
    begin = time.perf_counter()
    with local_ray():
        group = build_group(args)
        try:
            setup_s = time.perf_counter() - begin
            first_sync = sync(group)  # rollout policies start from the trainers' initial weights
            verify(group)
            reached = train_loop(group, args, history)
            verify(group)  # after the last update: still bit-exact
            versions = group.weight_version
        finally:
            group.shutdown()
    for path in save(args.out, history, args):
        print(f"wrote {path}")
    total = time.perf_counter() - begin
    final = history[-1]["mean_reward"] if history else 0.0
    print(
        f"setup {setup_s:.1f} s, first sync {first_sync * 1e3:.0f} ms, {len(history)} iterations, "
        f"{versions} versions synced, mean sync {np.mean([h['sync_s'] for h in history]) * 1e3:.0f} ms, "
        f"total {total:.1f} s"
    )
    if args.quick:
        print(f"pipeline ok: rollouts, FSDP2 training and bit-exact weight syncs (reward {final:.3f})")
        return 0
    if reached is None:
        print(f"target not reached: mean reward {final:.3f} < {args.target} in the budget", file=sys.stderr)
        return 1
    print(
        f"mean reward reached {args.target} at iteration {reached}, "
        f"{history[-1]['seconds']:.1f} s into training ({total:.1f} s in all)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
