"""`stand_down_refit_watchdog` as a controller calls it: on a Ray actor, while that actor's refit
is blocked on a silent trainer (the actor's other threads serve the call), then the trainer's
actor is killed and the refit ends by the lost peer."""

from __future__ import annotations

from typing import Any

import pytest
import torch

ray = pytest.importorskip("ray")

import pg_policies  # noqa: E402
from pg_policies import Tiny  # noqa: E402
from testkit import free_port, wait_until  # noqa: E402

from rlfleet.policygroup import PolicyConfig  # noqa: E402

pytestmark = pytest.mark.timeout(300)
ray.cloudpickle.register_pickle_by_value(pg_policies)  # the actors need not import tests/


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    shapes = Tiny(role="eval", device="cpu").model.state_dict()
    return {k: torch.randn(v.shape, generator=g) for k, v in shapes.items()}


@pytest.fixture
def pair(cluster: Any) -> tuple[Any, Any]:
    remote = ray.remote(Tiny).options(num_cpus=0, max_concurrency=4)
    config = PolicyConfig(group_timeout_s=60.0)
    train = remote.remote(config, role="train", index=0, device="cpu")
    gen = remote.remote(config, role="eval", index=0, device="cpu")
    port, ips = free_port(), ["127.0.0.1"]
    ray.get([
        train.init_nccl_reshard_comm_group.remote(ips, [port], 1, 0, 2, 0),
        gen.init_nccl_reshard_comm_group.remote(ips, [port], 1, -1, 2, 1),
    ], timeout=120)  # fmt: skip
    parallel = ({"tp": 1, "pp": 1}, {"tp": 1}, 1, 1)
    ray.get([x.prepare_nccl_reshard_refit_info.remote(*parallel) for x in (train, gen)], timeout=60)
    ray.get(train.load_state_dict.remote(weights(1)), timeout=60)
    ray.get([train.nccl_reshard_refit.remote(), gen.nccl_reshard_refit.remote()], timeout=60)
    yield train, gen
    for actor in (train, gen):
        ray.kill(actor)


def test_a_controller_stands_down_an_actors_refit_then_the_peer_dies(pair: tuple[Any, Any]) -> None:
    train, gen = pair
    v1 = ray.get(gen.get_weight_checksum.remote(), timeout=60)
    refit = gen.nccl_reshard_refit.remote(refit_timeout_s=5.0)  # the trainer never sends v2

    def stood_down() -> bool:  # 0 until the refit has armed its watchdog
        return bool(ray.get(gen.stand_down_refit_watchdog.remote(), timeout=30) >= 1)

    wait_until(stood_down, 60.0, "the refit's watchdog armed, then stood down", interval_s=0.02)
    ready, _ = ray.wait([refit], timeout=6.0)  # its 5 s deadline passes meanwhile
    assert not ready
    ray.kill(train)
    with pytest.raises(ray.exceptions.RayTaskError) as failure:
        ray.get(refit, timeout=120)
    assert "PeerLostError" in str(failure.value)
    assert ray.get(gen.get_weight_version.remote(), timeout=60) == 1
    assert ray.get(gen.get_weight_checksum.remote(), timeout=60) == v1
