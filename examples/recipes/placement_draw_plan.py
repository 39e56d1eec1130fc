"""Recipe: rlfleet-placement alone, planning and drawing a weight sync for a cluster spec.

Four 8-GPU nodes: one of trainers, three of rollout workers. The plan splits the model across
every trainer (no rank-0 funnel), relays it across nodes and fans out inside each node; it is
compared with the seed's plan and the lower bound, and drawn. Needs
`pip install "rlfleet-placement[draw]"` (networkx, matplotlib).

    python examples/recipes/placement_draw_plan.py [out.png]
"""

from __future__ import annotations

import sys

from rlfleet.placement import Topology, place_disaggregated, plan_transfer, seed_plan

MODEL_BYTES = 7_000_000_000 * 2  # a 7B model in bf16


def main(path: str = "out/placement_plan.png") -> int:
    topology = Topology.synthetic(nodes=4, gpus_per_node=8)  # NVLink 900 GB/s, 400 Gb/s NIC per GPU
    placement = place_disaggregated(topology, 8, 24, mode="packed")
    plan = plan_transfer(topology, placement, MODEL_BYTES)
    seed = seed_plan(topology, placement, MODEL_BYTES)
    print(
        f"ours: {plan.predicted_seconds * 1e3:.1f} ms | seed: {seed.predicted_seconds * 1e3:.1f} ms "
        f"| lower bound: {plan.lower_bound_seconds * 1e3:.1f} ms | {len(plan.steps)} transfers"
    )
    print("wrote", plan.draw(path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
