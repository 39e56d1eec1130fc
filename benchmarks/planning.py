"""Weight-sync plans on paper: ours, the seed's and the lower bound; planning speed; and the plans
of published systems priced with the same cost model, next to the times they published.

Run: hatch run python benchmarks/planning.py [--quick] [--json PATH]

Nothing is sent: every time is *predicted* by rlfleet.placement's cost model. Part 1 (grid):
``Topology.synthetic`` clusters of 8-GPU nodes (NVLink 450 GB/s each way, PCIe Gen5 64 GB/s,
one 400 Gb/s NIC per GPU, non-blocking fabric), trainers and rollout workers on whole nodes,
bf16 models, 64 MiB buckets, priced with the H100 profile (NCCL at 94% of line rate, per-bucket
overheads overlapped with the wire).

* Ours: ``plan_transfer`` (several senders, relay chains over every rail, one NVLink fan-out per
  node).
* Baseline: the seed's plan (``build_transfer_info_for_disaggregated``, "Double") costed as NCCL
  runs it: each broadcast splits into one channel per rail of the receiving node, so a node takes
  the model in through all 8 NICs; the seed is slower only where one trainer node serves several
  rollout nodes (it sends the model once per rollout node, ours once in all).
* Bound: bytes each receiver needs over the tightest line-rate cut (no efficiency, no overheads).

Planning speed: placement + ``plan_transfer`` for 1024 nodes x 8 GPUs on a freshly built
topology, median CPU seconds of this process (wall time beside it), worst train:rollout ratio.

Part 2 (published setups): see ``benchmarks/_published.py`` for what each row prices, its sources,
and which rows are fully published. Claims: ``worst_published_over_predicted`` (fully published
rows), ``max_plan_over_valid_bound`` (every row: our plan for the same cluster over the valid
bound), ``published_rows_below_bound`` (a published time under our bound would make it invalid).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import _claims
from _published import Row as PublishedRow
from _published import published_rows

from rlfleet.placement import Topology, place_disaggregated, plan_transfer, seed_plan

GPUS_PER_NODE = 8
RATIOS = ((1, 1), (1, 3))
MODELS = (("7B", 7e9), ("70B", 70e9), ("1T", 1e12))
CLUSTERS = (8, 64, 256)
BF16 = 2


@dataclass
class GridRow:
    cluster: str
    ratio: str
    model: str
    seed: float
    ours: float
    bound: float
    relay: str


def split_nodes(nodes: int, ratio: tuple[int, int]) -> tuple[int, int]:
    train = max(1, nodes * ratio[0] // (ratio[0] + ratio[1]))
    return train, nodes - train


def grid(clusters: tuple[int, ...], models: tuple[tuple[str, float], ...]) -> list[GridRow]:
    rows = []
    for nodes in clusters:
        topo = Topology.synthetic(nodes, GPUS_PER_NODE)
        for ratio in RATIOS:
            train, evals = split_nodes(nodes, ratio)
            placement = place_disaggregated(topo, train * GPUS_PER_NODE, evals * GPUS_PER_NODE)
            for name, params in models:
                model_bytes = int(params * BF16)
                ours = plan_transfer(topo, placement, model_bytes)
                seed = seed_plan(topo, placement, model_bytes, buffer="Double")
                rows.append(
                    GridRow(
                        f"{nodes}x{GPUS_PER_NODE}",
                        f"{ratio[0]}:{ratio[1]} ({train}+{evals})",
                        name,
                        seed.predicted_seconds,
                        ours.predicted_seconds,
                        ours.lower_bound_seconds,
                        ours.relay,
                    )
                )
    return rows


def time_planning(nodes: int, ratios: tuple[tuple[int, int], ...], repeats: int) -> dict[str, Any]:
    """Worst (over ratios) median CPU and wall seconds of placement + plan_transfer, cold caches."""
    out: dict[str, Any] = {"cpu": 0.0, "wall": 0.0, "ratio": "", "build": 0.0}
    builds = []
    for ratio in ratios:
        train, evals = split_nodes(nodes, ratio)
        cpu, wall = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            topo = Topology.synthetic(nodes, GPUS_PER_NODE)
            builds.append(time.perf_counter() - t0)
            c1, t1 = time.process_time(), time.perf_counter()
            placement = place_disaggregated(topo, train * GPUS_PER_NODE, evals * GPUS_PER_NODE)
            plan_transfer(topo, placement, int(1e12 * BF16))
            cpu.append(time.process_time() - c1)
            wall.append(time.perf_counter() - t1)
        if statistics.median(cpu) > out["cpu"]:
            label = f"{ratio[0]}:{ratio[1]}"
            out.update(cpu=statistics.median(cpu), wall=statistics.median(wall), ratio=label)
    out["build"] = statistics.median(builds)
    return out


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_grid(rows: list[GridRow]) -> None:
    header = f"{'cluster':>8} {'train:rollout nodes':>20} {'model':>5} {'seed':>10} {'ours':>10}"
    header += f" {'bound':>10} {'seed/ours':>9} {'ours/bound':>10}  relay"
    print("Part 1: predicted weight-sync time on paper (cost model; see the module docstring)")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.cluster:>8} {r.ratio:>20} {r.model:>5} {fmt(r.seed):>10} {fmt(r.ours):>10}"
            f" {fmt(r.bound):>10} {r.seed / r.ours:>8.2f}x {r.ours / r.bound:>9.3f}x  {r.relay}"
        )


def print_published(rows: list[PublishedRow]) -> None:
    print("\nPart 2: published setups, each system's own plan priced with the hardware profile")
    header = f"{'system':<18} {'published':>12} {'predicted':>10} {'ratio':>6} {'ours':>9} {'bound':>9}"
    header += f" {'ours/bound':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        lo, hi = r.published
        pub = f"{lo:.3g} s" if lo == hi else f"{lo:.3g}-{hi:.3g} s"
        mark = "" if r.fully_published else " *"
        print(
            f"{r.system + mark:<18} {pub:>12} {fmt(r.predicted):>10} {r.ratio:>5.2f}x {fmt(r.ours):>9} "
            f"{fmt(r.bound):>9} {r.ours_over_bound:>9.3f}x"
        )
        print(f"    {r.setup}")
        print("    terms: " + ", ".join(f"{k} {fmt(v)}" for k, v in r.terms.items()))
        if r.assumptions:
            print(f"    assumed: {r.assumptions}")
        print(f"    source: {r.source}")
    print("  * not fully published: shown, left out of worst_published_over_predicted")


def main(argv: list[str] | None = None) -> int:
    args = _claims.arguments(__doc__.split("\n\n")[0] if __doc__ else "").parse_args(argv)
    clusters = CLUSTERS[:2] if args.quick else CLUSTERS
    models = (MODELS[0], MODELS[2]) if args.quick else MODELS
    rows = grid(clusters, models)
    print_grid(rows)
    repeats = 1 if args.quick else 3
    timing = time_planning(1024, RATIOS[:1] if args.quick else RATIOS, repeats)
    print(
        f"\nPlanning 1024x{GPUS_PER_NODE} GPUs (placement + plan_transfer, cold caches, median of {repeats}, "
        f"worst ratio {timing['ratio']}): {timing['cpu']:.2f} s CPU ({timing['wall']:.2f} s wall); "
        f"building the topology: {timing['build']:.2f} s"
    )
    published = published_rows()
    print_published(published)
    full = [r for r in published if r.fully_published]
    claims = {
        "max_plan_over_lower_bound": _claims.claim(
            max(r.ours / r.bound for r in rows), 1.25, "x", higher_is_better=False
        ),
        "seed_over_plan_min": _claims.claim(min(r.seed / r.ours for r in rows), None, "x (faithful costing)"),
        "seed_over_plan_max": _claims.claim(max(r.seed / r.ours for r in rows), None, "x (faithful costing)"),
        "plan_1024x8_seconds": _claims.claim(timing["cpu"], 2.0, "s CPU", higher_is_better=False),
        "worst_published_over_predicted": _claims.claim(
            max(r.ratio for r in full), 2.0, "x", higher_is_better=False
        ),
        "max_plan_over_valid_bound": _claims.claim(
            max(r.ours_over_bound for r in published), 1.25, "x", higher_is_better=False
        ),
        "published_rows_below_bound": _claims.claim(
            sum(1 for r in published if r.published[0] < r.bound), 0, "rows", higher_is_better=False
        ),
    }
    return _claims.report(claims, args.json, title="planning claims")


if __name__ == "__main__":
    sys.exit(main())
