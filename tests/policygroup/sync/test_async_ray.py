"""Async RL on a 3-node Ray cluster: non-blocking syncs for every strategy (the snapshot is what
is sent while the trainer trains on), a burst of versions skipping to the newest, the staleness
bound under rolling updates with a slow worker, and background failures (a trainer or a rollout
worker killed mid-sync), each seen by the caller.

Layout: train0 and eval0 on node0 (the node buffer), eval2 and eval3 on node2 (a broadcast).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import async_policies  # noqa: E402
import pg_policies  # noqa: E402
from async_policies import AsyncPolicy  # noqa: E402
from pg_policies import OBS_DIM  # noqa: E402
from testkit import cluster_config, ready_group, spawn_actors, started_actors  # noqa: E402

from rlfleet.policygroup import (  # noqa: E402
    BatchedData,
    PolicyConfig,
    PolicyGroup,
    TrainWorkerDiedError,
    WeightBufferConfig,
)

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)
ray.cloudpickle.register_pickle_by_value(async_policies)

PLACES = {"train0": "node0", "eval0": "node0", "eval2": "node2", "eval3": "node2"}


def config(strategy: str = "Double", **options: Any) -> PolicyConfig:
    cuda_ipc = options.pop("cuda_ipc", "auto")
    return cluster_config(
        WeightBufferConfig(buffer_strategy=strategy, bucket_bytes=4096, cuda_ipc=cuda_ipc), **options
    )


@pytest.fixture(scope="module")
def actors(cluster: Any) -> Iterator[dict[str, Any]]:
    out = started_actors(AsyncPolicy, config(), PLACES)
    yield out
    for a in out.values():
        ray.kill(a)


@contextlib.contextmanager
def group_of(actors: dict[str, Any], cfg: PolicyConfig, evals: tuple[str, ...]) -> Iterator[PolicyGroup]:
    ray.get([actors[e].configure.remote(apply_delay=0.0) for e in evals], timeout=60)
    group = ready_group([actors["train0"]], [actors[e] for e in evals], cfg)
    try:
        yield group
    finally:
        group.shutdown()


def batch(n: int, seed: int = 0) -> BatchedData[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return BatchedData([f"env-{i}" for i in range(n)], torch.randn(n, OBS_DIM, generator=g).tolist())


def checksums(policies: list[Any]) -> list[str]:
    return list(ray.get([p.get_weight_checksum.remote() for p in policies], timeout=60))


@pytest.mark.parametrize(
    ("strategy", "options"),
    [("Double", {}), ("Shared", {}), ("None", {}), ("Sharded", {}), ("Double", {"cuda_ipc": "host"})],
    ids=["Double", "Shared", "None", "Sharded", "Double-ipc-host"],
)
def test_a_nonblocking_sync_sends_the_snapshot_while_the_trainer_trains_on(
    actors: dict[str, Any], strategy: str, options: dict[str, Any]
) -> None:
    evals = ("eval2", "eval3") if strategy == "Sharded" else ("eval0", "eval2", "eval3")
    with group_of(actors, config(strategy, **options), evals) as group:
        trainer = group.train_list[0]
        for step in range(1, 3):
            before = checksums([trainer])[0]
            handle = group.sync_weights(block=False)
            group.train(None, seed=step)  # overlaps the snapshot; its optimizer step waits for it
            report = handle.result()
            assert report is not None
            assert report.ok, report.summary()
            assert report.version == group.weight_version
            assert report.serving_stall_seconds is not None
            assert checksums(group.eval_list) == [before] * len(evals)
            assert checksums([trainer])[0] != before
            out = group.rollout_batch(batch(6, seed=step))
            assert ray.get(out.versions(), timeout=60) == [group.weight_version] * 6
            assert [r["version"] for r in ray.get(out.values(), timeout=60)] == [group.weight_version] * 6


@pytest.mark.parametrize(
    "evals",
    [("eval2", "eval3"), ("eval0", "eval2", "eval3")],
    ids=["broadcast", "broadcast-and-node-buffer"],
)
def test_a_burst_of_syncs_skips_to_the_newest_and_no_worker_serves_a_skipped_version(
    actors: dict[str, Any], evals: tuple[str, ...]
) -> None:
    """A broadcast alone skips the versions still waiting; with eval0 beside the trainer, the
    trainer's snapshot is also its node buffer's publish (a commit): every version is then sent
    in turn, each from its own snapshot slot (a burst once sent three versions from one slot:
    'the snapshot of v3 was overwritten by v6'), and the readers still move forward only."""
    publishes = "eval0" in evals
    with group_of(actors, config("Double"), evals) as group:
        first = group.weight_version + 1
        seen = [len(v) for v in ray.get([p.get_live_versions.remote() for p in group.eval_list], timeout=60)]
        ray.get([p.configure.remote(apply_delay=1.0) for p in group.eval_list], timeout=60)  # slow swaps
        handles = []
        for step in range(5):
            handles.append(group.sync_weights(block=False))
            handles[-1].snapshot_done()
            group.train(None, seed=10 + step)
        reports = [h.result() for h in handles]
        assert all(r is not None and r.ok for r in reports)
        sent = {r.version for r in reports if r is not None}
        skipped = {v for r in reports if r is not None for v in r.skipped_versions}
        versions = set(range(first, first + 5))
        if publishes:
            assert not skipped
            assert sent == versions
        else:
            assert skipped, "three syncs asked for during one slow sync: the middle ones are skipped"
            assert sent | skipped == versions
            assert not sent & skipped
        assert [h.skipped for h in handles] == [h.version in skipped for h in handles]
        assert max(sent) == first + 4
        lives = ray.get([p.get_live_versions.remote() for p in group.eval_list], timeout=60)
        for name, before, live in zip(evals, seen, lives, strict=True):
            new = live[before:]
            assert new == sorted(set(new)), (name, new)  # forward only, each version once
            assert new[-1] == first + 4
            if name != "eval0":  # broadcast receivers get only what the group sends
                assert set(new) <= sent, (name, new)
            if not publishes:
                assert len(new) < 5, (name, new)  # not a queue of every version
        assert group.eval_weight_versions() == [first + 4] * len(evals)
        assert group.verify_eval_weight_checksums() is False  # the trainer trained after the last snapshot


def test_staleness_stays_bounded_under_rolling_updates_with_a_slow_worker(actors: dict[str, Any]) -> None:
    evals = ("eval0", "eval2", "eval3")
    with group_of(actors, config("Double", max_staleness=1), evals) as group:
        ray.get(group.eval_list[1].configure.remote(apply_delay=0.4), timeout=60)  # one slow swap
        requests, worst = 0, 0
        for step in range(4):
            handle = group.sync_weights(block=False)
            group.train(None, seed=step)
            while not handle.done() or requests < 8 * (step + 1):
                latest = group.router.latest_version
                assert latest is not None
                out = group.rollout_batch(batch(4, seed=requests))
                versions = ray.get(out.versions(), timeout=60)
                worst = max(worst, *(latest - v for v in versions))
                requests += 4
            handle.result()
        assert worst <= 1, f"a sample came from weights {worst} versions behind the committed one"


@contextlib.contextmanager
def spares(strategy: str, evals: int) -> Iterator[PolicyGroup]:
    places = {"train0": "node0", **{f"eval{i}": "node0" for i in range(evals)}}
    out = spawn_actors(AsyncPolicy, config(strategy), places)
    try:
        ray.get([a.is_alive.remote() for a in out.values()], timeout=240)
        group = ready_group([out["train0"]], [out[f"eval{i}"] for i in range(evals)], config(strategy))
        try:
            yield group
        finally:
            with contextlib.suppress(Exception):
                group.shutdown()
    finally:
        for a in out.values():
            ray.kill(a)


def test_a_trainer_killed_during_a_background_sync_is_reported_by_the_next_call(cluster: Any) -> None:
    with spares("Shared", 1) as group:
        served = checksums(group.eval_list)
        trainer = group.train_list[0]
        ray.get(trainer.configure.remote(publish_delay=30.0), timeout=60)  # killed while snapshotting
        handle = group.sync_weights(block=False)
        ray.kill(trainer)
        assert handle.wait()  # failed in the background; nobody has looked at it yet
        with pytest.raises(TrainWorkerDiedError, match="trainer 0"):
            group.sync_weights(block=False)  # the next call says so
        with pytest.raises(TrainWorkerDiedError):
            handle.result()
        assert group.eval_weight_versions() == [1]
        assert checksums(group.eval_list) == served


def test_a_rollout_worker_killed_during_a_background_sync_is_dropped_and_the_rest_get_it(
    cluster: Any,
) -> None:
    with spares("Double", 2) as group:
        victim, survivor = group.eval_list
        ray.get(group.train_list[0].configure.remote(publish_delay=2.0), timeout=60)
        before = checksums(group.train_list)[0]
        handle = group.sync_weights(block=False)
        ray.kill(victim)
        report = handle.result()
        assert report is not None
        assert report.ok
        assert group.last_sync is not None
        assert group.last_sync.dropped == ("rollout worker 0",)
        assert group.eval_list == [survivor]
        assert group.eval_weight_versions() == [2]
        assert checksums([survivor]) == [before]
