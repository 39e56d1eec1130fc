"""Deltas through a policy group on a 3-node Ray cluster (issue 27): a group built with
``WeightBufferConfig(wire_dtype="bfloat16", delta="auto")`` sends its first version full and,
once every receiver of a broadcast holds the version before, only what changed; the
`SyncReport` says the bytes each step put on the wire and which receivers got which.

Layout: train0 and eval0 on node0 (the node buffer), eval2 and eval3 on node2 (a broadcast).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import MLPPolicy  # noqa: E402
from testkit import cluster_config, ready_group, started_actors  # noqa: E402

from rlfleet.placement import StepReport, SyncReport  # noqa: E402
from rlfleet.policygroup import PolicyConfig, WeightBufferConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)

PLACES = {"train0": "node0", "eval0": "node0", "eval2": "node2", "eval3": "node2"}


def config(strategy: str = "Double", cuda_ipc: str = "auto") -> PolicyConfig:
    return cluster_config(
        WeightBufferConfig(
            buffer_strategy=strategy,
            bucket_bytes=4096,
            wire_dtype="bfloat16",
            delta="auto",
            cuda_ipc=cuda_ipc,
        )
    )


@pytest.fixture(scope="module")
def actors(cluster: Any) -> Iterator[dict[str, Any]]:
    out = started_actors(MLPPolicy, config(), PLACES)
    yield out
    for a in out.values():
        ray.kill(a)


def steps_by(report: SyncReport | None) -> dict[int, StepReport]:
    assert report is not None
    assert report.ok, report
    return {s.index: s for s in report.steps}


@pytest.mark.parametrize("strategy", ["Double", "Shared"])
def test_the_first_sync_goes_full_and_the_next_sends_only_what_changed(
    actors: dict[str, Any], strategy: str
) -> None:
    trainer = actors["train0"]
    group = ready_group([trainer], [actors[e] for e in ("eval0", "eval2", "eval3")], config(strategy))
    try:
        plan = group.sync_plan
        assert plan is not None
        broadcasts = [s for s in plan.steps if s.transport == "broadcast"]
        assert broadcasts, [s.transport for s in plan.steps]  # node2 has no trainer
        first = group.last_sync_report
        assert first is not None
        for step in plan.steps:  # no receiver held a base: every step went full
            got = steps_by(first)[step.index]
            assert got.delta_base is None
            assert got.bytes_on_wire == got.full_bytes
            assert got.full_bytes is not None
            assert got.full_bytes > 0
            assert (got.full_receivers, got.delta_receivers) == (step.dst, ())
        # a few weights change: the next version differs from the last in a few bf16 words
        name, state = change_a_few_weights(trainer)
        second = group.sync_weights()
        assert second is not None
        assert second is group.last_sync_report
        for step in plan.steps:
            got = steps_by(second)[step.index]
            if step.transport == "broadcast":
                assert got.delta_base == first.version
                assert got.bytes_on_wire is not None
                assert got.full_bytes is not None
                assert got.bytes_on_wire < got.full_bytes / 4, got
                assert (got.delta_receivers, got.full_receivers, got.lacking_base) == (step.dst, (), ())
            else:  # the node buffer carries full versions
                assert got.delta_base is None
                assert got.full_receivers == step.dst
        assert second.bytes_on_wire is not None
        assert second.full_bytes is not None
        assert second.bytes_on_wire < second.full_bytes
        print(f"first sync: {first.summary()}\nsecond sync: {second.summary()}")
        assert f"delta from v{first.version} to" in second.summary()
        assert group.verify_eval_weight_checksums()  # bit for bit, as the trainer serves them in bf16
        served = ray.get(actors["eval2"].get_state_dict.remote(), timeout=60)
        assert torch.equal(served[name], state[name].to(torch.bfloat16))
    finally:
        group.shutdown()


def change_a_few_weights(trainer: Any) -> tuple[str, dict[str, torch.Tensor]]:
    state = ray.get(trainer.get_state_dict.remote(), timeout=60)
    name = next(n for n, t in state.items() if t.is_floating_point() and t.numel() >= 4)
    state[name].view(-1)[:4] += 1.0
    ray.get(trainer.load_state_dict.remote(state), timeout=60)
    return name, state


def test_a_cuda_ipc_step_sends_deltas_and_reports_them(actors: dict[str, Any]) -> None:
    """``cuda_ipc="host"``: eval0, beside the trainer, takes each version through a CUDA IPC
    channel (host slots); with ``delta="auto"`` the second version fills its slots with only
    what changed, and the report says so, as for the broadcast to node2."""
    trainer = actors["train0"]
    evals = [actors[e] for e in ("eval0", "eval2", "eval3")]
    group = ready_group([trainer], evals, config("Double", cuda_ipc="host"))
    try:
        plan = group.sync_plan
        assert plan is not None
        [ipc] = [s for s in plan.steps if s.transport == "cuda_ipc"]
        assert ipc.dst == (group.process_id(evals[0]),)
        first = group.last_sync_report
        assert first is not None
        got = steps_by(first)[ipc.index]
        assert (got.delta_base, got.full_receivers, got.delta_receivers) == (None, ipc.dst, ())
        assert got.bytes_on_wire == got.full_bytes
        name, state = change_a_few_weights(trainer)
        second = group.sync_weights()
        got = steps_by(second)[ipc.index]
        assert got.delta_base == first.version
        assert (got.delta_receivers, got.full_receivers, got.lacking_base) == (ipc.dst, (), ())
        assert got.bytes_on_wire is not None
        assert got.full_bytes is not None
        assert got.bytes_on_wire < got.full_bytes / 4, got
        assert group.verify_eval_weight_checksums()  # bit for bit, in bf16
        served = ray.get(evals[0].get_state_dict.remote(), timeout=60)
        assert torch.equal(served[name], state[name].to(torch.bfloat16))
    finally:
        group.shutdown()
