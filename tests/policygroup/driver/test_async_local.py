"""Async RL over local policy objects (one process, real node buffers): non-blocking syncs, the
version behind every rollout result, the staleness bound the group gives the router, the new-
version hook, and the asyncio rollout API."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from async_policies import AsyncPolicy
from pg_policies import OBS_DIM

from rlfleet.policygroup import (
    BatchedData,
    PolicyConfig,
    PolicyGroup,
    PolicyGroupError,
    TrainConfig,
    WeightBufferConfig,
)
from rlfleet.routing import PrefixAwareRouter


def group_of(strategy: str = "Shared", n_eval: int = 2, **options: object) -> PolicyGroup:
    cfg = PolicyConfig(
        weight_buffer=WeightBufferConfig(buffer_strategy=strategy, bucket_bytes=2048),
        sync_timeout_s=30.0,
        rpc_timeout_s=30.0,
        drain_timeout_s=10.0,
        **options,  # type: ignore[arg-type]
    )
    group = PolicyGroup(
        [AsyncPolicy(cfg, role="train")], [AsyncPolicy(cfg, role="eval", index=i) for i in range(n_eval)], cfg
    )
    group.init(TrainConfig(lr=1e-2))
    group.init_placement_info()
    group.init_weight_buffer()
    return group


def batch(n: int = 4) -> BatchedData[list[float]]:
    return BatchedData([f"env-{i}" for i in range(n)], torch.randn(n, OBS_DIM).tolist())


def test_async_options_are_checked_and_reach_the_router() -> None:
    with pytest.raises(ValueError, match=r"max_staleness must be None .* got -1"):
        PolicyConfig(max_staleness=-1)
    with pytest.raises(ValueError, match=r"max_staleness must be None .* got True"):
        PolicyConfig(max_staleness=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="on_new_version 'drop' is unknown; valid: forget, keep"):
        PolicyConfig(router_type="prefix_aware", on_new_version="drop")
    with pytest.raises(ValueError, match="on_new_version 'keep' applies to router_type 'prefix_aware'"):
        PolicyConfig(router_type="least_load", on_new_version="keep")
    group = group_of(max_staleness=1, router_type="prefix_aware", on_new_version="keep")
    try:
        router = group.router
        assert isinstance(router, PrefixAwareRouter)
        assert (router.max_staleness, router.on_new_version) == (1, "keep")
        group.sync_weights()
        assert router.latest_version == group.weight_version == 1  # announced when it committed
    finally:
        group.shutdown()


def test_every_rollout_result_carries_the_version_that_produced_it() -> None:
    group = group_of()
    try:
        assert group.rollout_batch(batch()).versions() == [0] * 4
        group.sync_weights()
        out = group.rollout_batch(batch())
        assert out.versions() == [1] * 4
        assert [r["version"] for r in out.values()] == [1] * 4  # what the workers themselves report
        with pytest.raises(ValueError, match="carries no weight versions"):
            batch().versions()
    finally:
        group.shutdown()


def test_the_new_version_hook_runs_once_per_version_on_rollout_workers() -> None:
    group = group_of()
    try:
        for _ in range(3):
            group.sync_weights()
            group.rollout_batch(batch())
        assert [p.get_live_versions() for p in group.eval_list] == [[1, 2, 3]] * 2
        assert group.train_list[0].get_live_versions() == []
    finally:
        group.shutdown()


def test_a_nonblocking_sync_sends_the_snapshot_not_the_update_that_follows() -> None:
    """The snapshot (here the node-buffer write, made slow) overlaps the next train step; only its
    optimizer step waits for it: the version sent is the weights of the call, bit for bit."""
    group = group_of()
    trainer = group.train_list[0]
    trainer.configure(publish_delay=0.3)
    try:
        for step in range(1, 4):
            before = trainer.get_weight_checksum()
            handle = group.sync_weights(block=False)
            group.train(None, seed=step)  # its forward/backward run while the snapshot is taken
            assert trainer.get_weight_checksum() != before
            report = handle.result()
            assert report is not None
            assert report.ok
            assert report.version == step
            assert report.serving_stall_seconds is not None
            assert [p.get_weight_checksum() for p in group.eval_list] == [before] * 2
            assert group.eval_weight_versions() == [step] * 2
    finally:
        group.shutdown()


def test_a_failed_background_sync_is_raised_by_the_next_call_and_the_last_version_stays() -> None:
    group = group_of()
    trainer = group.train_list[0]
    try:
        group.sync_weights()
        served = [p.get_weight_checksum() for p in group.eval_list]
        trainer.configure(fail_publish=True)
        handle = group.sync_weights(block=False)
        assert handle.wait()  # finished; nobody has looked at it
        group.train(None, seed=1)
        trainer.configure(fail_publish=False)
        with pytest.raises(PolicyGroupError, match="injected: the node buffer write of v2 failed"):
            group.sync_weights()
        assert group.eval_weight_versions() == [1, 1]
        assert [p.get_weight_checksum() for p in group.eval_list] == served
        assert group.sync_weights() is not None  # raised once: the group goes on
        assert group.eval_weight_versions() == [3, 3]  # v2 was used by the failed sync
        assert group.verify_eval_weight_checksums()
    finally:
        group.shutdown()


def test_the_asyncio_rollout_waits_for_a_recent_worker_without_blocking_the_loop() -> None:
    group = group_of(max_staleness=0)
    try:
        group.sync_weights()
        group.router.set_latest_version(2)  # v2 committed, nobody swapped yet: every worker is stale

        async def main() -> tuple[BatchedData[object], int]:
            ticks = 0
            request = asyncio.ensure_future(group.rollout_batch_async(batch(2), timeout=60))
            syncing = threading.Thread(target=group.sync_weights)  # brings every worker to v2
            while not request.done():
                ticks += 1
                if ticks == 20:
                    syncing.start()
                await asyncio.sleep(0.005)
            syncing.join(60)
            return request.result(), ticks

        out, ticks = asyncio.run(main())
        assert ticks >= 20  # the loop ran while the request waited (20 ticks before the sync began)
        assert out.versions() == [2, 2]
        assert all(isinstance(v, dict) for v in out.values())
    finally:
        group.shutdown()


@pytest.mark.timeout(120)
def test_a_burst_of_nonblocking_syncs_through_the_node_buffer_applies_each_in_turn() -> None:
    """Each node-buffer snapshot commits its version in a two-slot node buffer: a burst must not
    leave a writer waiting for a slot that only the swap of the version it writes would free."""
    group = group_of("Shared")
    try:
        group.sync_weights()
        handles = []
        for step in range(5):
            handles.append(group.sync_weights(block=False))
            group.train(None, seed=step)  # its update waits for the snapshot, nothing else
        reports = [h.result(timeout=60) for h in handles]
        assert [r.version for r in reports if r is not None] == [2, 3, 4, 5, 6]
        assert not any(h.skipped for h in handles)
        assert group.eval_weight_versions() == [6, 6]
        lives = [p.get_live_versions() for p in group.eval_list]
        assert all(live == sorted(set(live)) and live[-1] == 6 for live in lives), lives
    finally:
        group.shutdown()
