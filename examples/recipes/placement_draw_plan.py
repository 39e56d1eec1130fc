"""Recipe: rlfleet-placement alone, planning, pricing and drawing a weight sync.

Part 1 plans an executable sync (``plan_sync`` -> ``SyncPlan``, what policygroup runs) for a small
GPU cluster: 2 trainers on their own node, 6 rollout workers on 2 nodes with a shared buffer
each; it is compared with the seed's plan on the same cluster and drawn. Part 2 prices a paper
plan for a large cluster (``plan_transfer``) against the seed's and the lower bound. Needs
``pip install "./packages/placement[draw]"`` (networkx, matplotlib; README: Install).

    python examples/recipes/placement_draw_plan.py [out.png]
"""

from __future__ import annotations

import sys

from rlfleet.placement import (
    HARDWARE_PROFILES,
    SyncProcess,
    Topology,
    place_disaggregated,
    plan_sync,
    plan_transfer,
    seed_plan,
    seed_sync_plan,
)

MODEL_BYTES = 7_000_000_000 * 2  # a 7B model in bf16
BUCKET = 512 * 2**20


def main(path: str = "out/placement_sync_plan.png") -> int:
    topology = Topology.synthetic(3, 8)  # H100-style nodes: NVLink, 8 x 400 Gb/s NICs each
    processes = [SyncProcess(f"trainer-{i}", "trainer", "node0", f"cuda:{i}") for i in range(2)]
    processes += [
        SyncProcess(f"rollout-{i}", "rollout", f"node{1 + i // 3}", f"cuda:{i % 3}") for i in range(6)
    ]
    buckets = [BUCKET] * (MODEL_BYTES // BUCKET) + [MODEL_BYTES % BUCKET]
    cost = HARDWARE_PROFILES["H100"]
    ours = plan_sync(processes, buckets, "Shared", topology=topology, cost=cost, cuda_ipc=False)
    seed = seed_sync_plan(processes, buckets, "Shared", topology=topology, cost=cost)
    print(
        f"sync plan: ours {ours.predicted_seconds * 1e3:.0f} ms ({len(ours.steps)} steps, "
        f"groups {ours.groups()}) | seed {seed.predicted_seconds * 1e3:.0f} ms | "
        f"bound {ours.lower_bound_seconds * 1e3:.0f} ms"
    )
    print("priced on:", ours.topology_source)
    print("wrote", ours.draw(path))

    big = Topology.synthetic(32, 8)
    placement = place_disaggregated(big, 64, 192)  # 8 trainer nodes, 24 rollout nodes
    paper = plan_transfer(big, placement, 70 * 10**9 * 2)
    baseline = seed_plan(big, placement, 70 * 10**9 * 2)
    print(
        f"70B on 32x8 GPUs (paper plan): ours {paper.predicted_seconds:.2f} s, "
        f"seed {baseline.predicted_seconds:.2f} s, bound {paper.lower_bound_seconds:.2f} s ({paper.relay})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
