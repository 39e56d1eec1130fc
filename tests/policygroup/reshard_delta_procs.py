"""Process bodies for the reshard delta test: nccl_reshard refits with ``delta="auto"``.

Training PP2 -> generation TP2 over gloo, as `reshard_worker_procs`, but the weights move a
little each version (fp32 masters at a small step, served in bf16, so most bf16 elements keep
their bits) and ``WeightBufferConfig(delta="auto")``. The steps:

- v1 full (no base yet), v2 and v3 deltas to both generation workers;
- v4: generation worker 1 was reset (weights zeroed, version 0, as after a restart): full to
  it from both stages, deltas to worker 0;
- v5: generation worker 0's base has a flipped bit: its rebuild fails the digest, nobody
  applies v5 and the trainers forget their base; the retry of v5 goes full to both;
- v6: deltas again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import reshard_worker_procs as base
import torch
from refit_procs import report
from testkit import outcome

from rlfleet.placement import ParamSpec
from rlfleet.policygroup import PolicyConfig, WeightBufferConfig

H, V = 64, 256
TIMEOUT_S = 60.0
#: (step name, version the trainers send): v5 is sent twice, the first time onto a corrupted base.
STEPS = (("v1", 1), ("v2", 2), ("v3", 3), ("v4", 4), ("v5", 5), ("v5_retry", 5), ("v6", 6))
RESET_BEFORE = ("v4", 1)  # (step, generation worker): weights zeroed, version 0
CORRUPT_BEFORE = ("v5", 0)  # (step, generation worker): one bit of its base flipped


def specs() -> list[ParamSpec]:
    return base.specs(H, V)


def pieces(version: int) -> dict[str, torch.Tensor]:
    """Each piece at `version` in its plan dtype: a fixed start plus `version` small fp32 steps."""
    g = torch.Generator().manual_seed(7)
    out = {}
    for s in specs():
        for piece, size in s.pieces:
            shape = list(s.shape)
            shape[s.concat_dim] = size
            start = torch.randn(shape, generator=g) * 0.02
            step = torch.randn(shape, generator=g) * 2e-6
            out[piece] = (start + version * step).to(getattr(torch, s.dtype))
    return out


class Policy(base.Policy):
    """`reshard_worker_procs.Policy` at this test's size, refitting with deltas."""

    def __init__(self, role: str, index: int) -> None:
        config = PolicyConfig(group_timeout_s=30.0, weight_buffer=WeightBufferConfig(delta="auto"))
        super().__init__(role, index, config)

    def specs(self) -> list[ParamSpec]:
        return specs()

    def pieces(self, version: int) -> dict[str, torch.Tensor]:
        return pieces(version)

    def reset(self) -> None:
        """What a restarted generation worker holds: zeros at version 0."""
        self.load_state_dict({k: torch.zeros_like(v) for k, v in self.model.state_dict().items()})
        self.set_weight_version(0)

    def corrupt(self) -> None:
        """Flip one bit of a local weight, leaving the version as it is."""
        name = next(iter(self.expected(0)))
        with torch.no_grad():
            getattr(self.model, name).detach().view(-1).view(torch.int16)[11] ^= 0x40


def worker(rank: int, ports: Sequence[int], queue: Any) -> None:
    """World ranks 0, 1: training stages 0 and 1; 2, 3: generation tp ranks 0 and 1."""
    report(queue, rank, lambda: _body(rank, ports))


def _body(rank: int, ports: Sequence[int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    train = rank < 2
    policy = Policy("train" if train else "eval", rank if train else rank - 2)
    ips = ["127.0.0.1", "127.0.0.1"]
    member = 0 if train else 1 + policy.index
    policy.init_nccl_reshard_comm_group(ips, list(ports), 2, rank if train else -1, 3, member)
    policy.prepare_nccl_reshard_refit_info(base.TRAIN, base.GEN, 2, 2)
    return {name: _step(policy, name, version) for name, version in STEPS}


def _step(policy: Policy, name: str, version: int) -> dict[str, Any]:
    """One refit on this worker: its outcome, its stats and (generation side) what it holds."""
    if policy.side == "train":
        policy.load(version)
    elif (name, policy.index) == RESET_BEFORE:
        policy.reset()
    elif (name, policy.index) == CORRUPT_BEFORE:
        policy.corrupt()
    result = outcome(lambda: policy.nccl_reshard_refit(refit_timeout_s=TIMEOUT_S))
    result["stats"] = policy.get_reshard_stats()
    result["version"] = policy.get_weight_version()
    if policy.side == "gen":
        result["exact"] = policy.matches(result["version"])
    return result


def run(timeout: float = 240.0) -> dict[int, Any]:
    return base.run(timeout, worker)
