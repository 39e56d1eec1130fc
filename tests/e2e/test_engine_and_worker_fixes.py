"""Two fixes from issue 24: `LoadWeightsConsumer.last_error` is cleared by a version that repairs
the engine, and a Ray worker asks whether it was restarted without Ray's deprecated call (every
actor printed a RayDeprecationWarning)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import testkit
import torch

from rlfleet.weightsync import Layout, LoadWeightsConsumer, PartialLoadError, feed, pack_bucket

STATE = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}


class Engine:
    """An engine's model class: ``load_weights`` copies each pair into its parameters."""

    def __init__(self) -> None:
        self.params = {name: torch.zeros_like(t) for name, t in STATE.items()}
        self.fail_at: int | None = None
        self.pairs = 0

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.pairs += 1
            if self.fail_at is not None and self.pairs >= self.fail_at:
                raise RuntimeError("engine broke")
            self.params[name].copy_(tensor)


def _consumer(engine: Engine, mode: str, told: list[PartialLoadError]) -> LoadWeightsConsumer:
    layout = Layout.from_state_dict(STATE, bucket_bytes=64 * 64 * 4)  # one tensor per bucket
    return LoadWeightsConsumer(
        layout, engine.load_weights, mode=mode, expected=engine.params, on_partial=told.append
    )


def test_stream_partial_load_is_in_last_error_until_a_version_repairs_it() -> None:
    engine, told = Engine(), []
    consumer = _consumer(engine, "stream", told)
    feed(consumer, STATE.items(), 1)
    consumer.begin(2)
    buffer = torch.empty(consumer.layout.max_bucket_nbytes, dtype=torch.uint8)
    consumer.consume(0, pack_bucket(consumer.layout, 0, STATE, buffer))  # reaches the engine
    consumer.abort(ConnectionError("sender died"))  # what a transport does; it raises its own error
    assert isinstance(consumer.last_error, PartialLoadError)
    assert told == [consumer.last_error]
    assert consumer.torn
    assert consumer.version == 1
    feed(consumer, STATE.items(), 3)  # a complete version repairs the engine
    assert consumer.version == 3
    assert not consumer.torn
    assert consumer.last_error is None  # was the stale PartialLoadError of version 2


def test_staged_engine_failure_then_a_repairing_version_clears_last_error() -> None:
    engine, told = Engine(), []
    consumer = _consumer(engine, "staged", told)
    engine.fail_at = 2
    with pytest.raises(PartialLoadError, match="mode 'staged'"):
        feed(consumer, STATE.items(), 1)
    assert isinstance(consumer.last_error, PartialLoadError)
    assert told == [consumer.last_error]
    engine.fail_at = None
    feed(consumer, STATE.items(), 2)
    assert consumer.last_error is None
    assert consumer.version == 2


@pytest.mark.timeout(120)
def test_a_ray_worker_learns_it_was_restarted_without_a_deprecation_warning(cluster: Any) -> None:
    ray = pytest.importorskip("ray")

    @ray.remote(max_restarts=1, num_cpus=0)
    class Probe:
        def restarted(self) -> tuple[bool, list[str]]:
            from rlfleet.policygroup import _ray_node

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = _ray_node.was_restarted()
            return value, [f"{w.category.__name__}: {w.message}" for w in caught]

        def die(self) -> None:
            import os

            os._exit(1)

    probe = Probe.remote()
    assert ray.get(probe.restarted.remote(), timeout=60) == (False, [])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(probe.die.remote(), timeout=60)

    def restarted() -> Any:
        try:
            return ray.get(probe.restarted.remote(), timeout=10)
        except ray.exceptions.RayActorError:
            return None

    assert testkit.wait_until(restarted, 60, "the probe's restart") == (True, [])
    ray.kill(probe)
