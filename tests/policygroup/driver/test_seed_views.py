"""The seed's public views of a policy group, derived from the plan that runs."""

from __future__ import annotations

from pg_policies import Tiny

from rlfleet.policygroup import PolicyConfig, PolicyGroup, WeightBufferConfig


def test_router_map_is_the_executed_plans() -> None:
    config = PolicyConfig(weight_buffer=WeightBufferConfig(buffer_strategy="Double", bucket_bytes=4096))
    group = PolicyGroup([Tiny(config, "train")], [Tiny(config, "eval", index=i) for i in range(2)], config)
    try:
        assert group.router_map == {}  # no plan before the placement is known
        group.init_placement_info()
        group.init_weight_buffer()
        plan = group.sync_plan
        assert plan is not None
        # one node ("local", or this process's Ray node when an earlier test started Ray here):
        # its trainer feeds its own rollout workers
        [(node, fed)] = group.router_map.items()
        assert fed == [node]
        assert group.router_map == plan.router_map()
        assert set(group.transfer_info) == set(group.router_map)
    finally:
        group.shutdown()
