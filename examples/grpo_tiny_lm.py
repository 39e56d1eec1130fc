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
    hatch run grpo --async         # trainer and rollouts at once, samples at most 1 version behind

With ``--async`` the rollout policies generate the next batch while the trainers train on this
one: each update is written into the node buffer (the snapshot the trainers wait for) and
``sync_weights(block=False)`` swaps the rollout policies in the background; the router bounds
staleness (``max_staleness=1``) and every sample carries the version that produced it, printed
per batch as versions behind the trainer.

Every sync's bytes are printed (per iteration in the progress line and the CSV's ``sync_bytes``,
per batch with ``--async``, in all at the end). They are full versions: the node buffer the
trainers stream into carries the whole model each time, and rlfleet's deltas ride broadcasts
between nodes (``WeightBufferConfig(delta="auto")``, see ``hatch run demo --nodes 3``), which
this one-node example has none of. They would not pay here anyway: Adam at lr 3e-3 changes
about 96% of the weights every step (benchmarks/delta.py, workload b).

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
    p.add_argument(
        "--async",
        dest="async_",
        action="store_true",
        help="train and generate at once (max_staleness=1): prints the versions behind per batch",
    )
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
        rollout_mode="async" if args.async_ else "sync",
        router_type="least_load",
        weight_buffer=WeightBufferConfig(
            type="CPUWeightBuffer", buffer_strategy="Shared", bucket_bytes=1 << 20
        ),
        max_staleness=1 if args.async_ else None,  # the router never serves older samples
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


#: Printed once: why this example's syncs are full versions (the module docstring says more).
DELTA_NOTE = (
    "deltas: none here: the trainers stream every version into the node buffer, which carries "
    "full versions (deltas ride cross-node broadcasts; this example runs on one node)"
)


def sync_bytes(group: Any) -> int:
    """The bytes the last sync put on the wire (its `SyncReport`; 0 if it reported none)."""
    report = group.last_sync_report
    return 0 if report is None or report.bytes_on_wire is None else int(report.bytes_on_wire)


def sync(group: Any, timeout_s: float = 120.0) -> float:
    """Stream the trainers' new weights into the node buffer, then swap the rollout policies."""
    start = time.perf_counter()
    version = group.weight_version + 1
    ray.get([t.export_weights.remote(version, timeout_s) for t in group.train_list], timeout=timeout_s)
    group.sync_weights()
    if group.weight_version != version or set(group.eval_weight_versions()) != {version}:
        raise RuntimeError(f"sync of version {version}: rollout policies hold {group.eval_weight_versions()}")
    return time.perf_counter() - start


def start_rollout(
    group: Any, args: argparse.Namespace, generator: torch.Generator, it: int
) -> tuple[torch.Tensor, BatchedData[Any]]:
    """Prompts out through `rollout_batch` (Ray tasks: they run while the driver goes on)."""
    prompts = make_prompts(args.prompts, args.length, generator)
    chunks = prompts.chunk(args.requests)
    ids = [f"prompts-{i}" for i in range(args.requests)]
    requests = [
        {"prompts": c.numpy(), "group": args.group, "seed": args.seed * 1_000_003 + it * 97 + i}
        for i, c in enumerate(chunks)
    ]
    return prompts, group.rollout_batch(BatchedData(ids, requests))


def finish_rollout(
    prompts: torch.Tensor, out: BatchedData[Any], args: argparse.Namespace
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """The answers, scored, and the weight version that produced each request's answers."""
    values = ray.get(list(out.values()), timeout=120)
    versions = [int(v) for v in ray.get(list(out.versions()), timeout=120)]
    answers = torch.cat([torch.as_tensor(o["answers"]) for o in values])
    repeated = prompts.repeat_interleave(args.group, 0)
    return {"prompts": repeated, "answers": answers, "reward": rewards(repeated, answers)}, versions


def rollout(
    group: Any, args: argparse.Namespace, generator: torch.Generator, it: int
) -> dict[str, torch.Tensor]:
    """Prompts out through `rollout_batch`, answers back; every answer from the current version."""
    batch, versions = finish_rollout(*start_rollout(group, args, generator, it), args)
    if set(versions) != {group.weight_version}:
        raise RuntimeError(
            f"iteration {it}: rollouts used versions {set(versions)}, expected {group.weight_version}"
        )
    return batch


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


@contextmanager
def progress(args: argparse.Namespace) -> Iterator[tuple[Any, Any]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [
        TextColumn("iter {task.completed:>3}/{task.total}"),
        BarColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
    ]
    with Progress(*columns, disable=args.no_progress) as bar:
        yield bar, bar.add_task("", total=args.iterations)


def record(
    history: list[dict[str, float]], args: argparse.Namespace, batch: dict[str, torch.Tensor], **row: float
) -> float:
    """One iteration's row of the reward curve; the mean reward of the last `window` iterations."""
    history.append(
        {
            "iteration": row.pop("iteration"),
            "seconds": row.pop("seconds"),
            "mean_reward": float(batch["reward"].mean()),
            "exact": float((batch["reward"] == 1).float().mean()),
            **row,
        }
    )
    return float(np.mean([h["mean_reward"] for h in history[-args.window :]]))


def train_loop(group: Any, args: argparse.Namespace, history: list[dict[str, float]]) -> int | None:
    generator = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    with progress(args) as (bar, task):
        for it in range(1, args.iterations + 1):
            t0 = time.perf_counter()
            batch = rollout(group, args, generator, it)
            t1 = time.perf_counter()
            group.update_dataset(shards(batch, args.group, len(group.train_list)))
            stats = group.train()
            t2 = time.perf_counter()
            sync_s = sync(group)
            moved = sync_bytes(group)
            recent = record(
                history, args, batch, iteration=it, seconds=time.perf_counter() - start, loss=stats["loss"],
                rollout_s=t1 - t0, train_s=t2 - t1, sync_s=sync_s, version=group.weight_version,
                sync_bytes=moved,
            )  # fmt: skip
            bar.update(
                task,
                advance=1,
                description=f"reward {history[-1]['mean_reward']:.3f} (last {args.window}: {recent:.3f}) "
                f"| sync {sync_s * 1e3:4.0f} ms, {moved / 1e6:.2f} MB | v{group.weight_version}",
            )
            if not args.quick and len(history) >= args.window and recent >= args.target:
                return it
            if time.perf_counter() - start > args.max_seconds:
                return None
    return None


def export(group: Any, timeout_s: float = 120.0) -> int:
    """Every trainer gathers its new weights; the node buffer's writer packs them as the next
    version: the snapshot, the one thing the trainers wait for."""
    version = int(group.next_weight_version)
    ray.get([t.export_weights.remote(version, timeout_s) for t in group.train_list], timeout=timeout_s)
    return version


def async_loop(group: Any, args: argparse.Namespace, history: list[dict[str, float]]) -> int | None:
    """The rollout policies generate batch k+1 while the trainers train on batch k; each update is
    swapped in by a background sync. A batch's samples come from the version before the one
    the trainers are at, or that one (``max_staleness=1``): printed as versions behind."""
    generator = torch.Generator().manual_seed(args.seed)
    pending = start_rollout(group, args, generator, 1)
    handle, trained, start, reached = None, group.weight_version, time.perf_counter(), None
    with progress(args) as (bar, task):
        for it in range(1, args.iterations + 1):
            t0 = time.perf_counter()
            batch, versions = finish_rollout(*pending, args)
            behind = sorted({trained - v for v in versions})
            if behind[-1] > 1:
                raise RuntimeError(
                    f"batch {it}: samples {behind[-1]} versions behind the trainers (bound: 1)"
                )
            if handle is not None:
                handle.result()  # the last update is live: the next batch is at most one behind
            t1 = time.perf_counter()
            if it < args.iterations:
                pending = start_rollout(group, args, generator, it + 1)  # generates during training
            group.update_dataset(shards(batch, args.group, len(group.train_list)))
            stats = group.train()
            t2 = time.perf_counter()
            moved = sync_bytes(group)  # the last background sync's (the one that finished above)
            trained = export(group)
            handle = group.sync_weights(block=False)  # stage and swap in the background
            t3 = time.perf_counter()
            recent = record(
                history, args, batch, iteration=it, seconds=time.perf_counter() - start, loss=stats["loss"],
                rollout_s=t1 - t0, train_s=t2 - t1, sync_s=t3 - t2, version=trained, behind=max(behind),
                sync_bytes=moved,
            )  # fmt: skip
            bar.console.print(  # one line per batch (<= 80 columns)
                f"batch {it:>3}: reward {history[-1]['mean_reward']:.3f} (last {args.window}: "
                f"{recent:.3f}) | versions behind {behind} | trained v{trained}",
                highlight=False,
            )
            bar.console.print(f"  last sync moved {moved / 1e6:.3f} MB (a full version)", highlight=False)
            bar.update(task, advance=1, description=f"reward {recent:.3f} | v{trained}")
            if not args.quick and len(history) >= args.window and recent >= args.target:
                reached = it
                break
            if time.perf_counter() - start > args.max_seconds:
                break
    if handle is not None:
        handle.result()  # the newest version everywhere (verified next)
    return reached


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
            print(DELTA_NOTE)
            print(f"first sync {group.last_sync_report.summary()}")
            verify(group)
            reached = (async_loop if args.async_ else train_loop)(group, args, history)
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
    sent = [h["sync_bytes"] for h in history if h.get("sync_bytes")]
    if sent:
        print(
            f"bytes per sync: {np.mean(sent) / 1e6:.3f} MB on the wire (full versions through the node "
            f"buffer), {sum(sent) / 1e6:.2f} MB in {len(sent)} syncs"
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
