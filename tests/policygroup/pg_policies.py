"""Small torch policies for the policy-group tests (pickled by value into Ray workers)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rlfleet.policygroup import BasePolicy

OBS_DIM = 8
ACTIONS = 4


def make_model() -> nn.Module:
    torch.manual_seed(1234)  # every worker starts from the same weights
    return nn.Sequential(
        nn.Linear(OBS_DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, ACTIONS)
    )


class Tiny(BasePolicy):
    """The smallest policy with a hidden layer: for the worker-surface and refit tests, where only
    the calls matter (not what the model computes)."""

    def build_model(self) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


class MLPPolicy(BasePolicy):
    """A few MLP layers; rollouts return logits so tests can tell which weights served them."""

    def build_model(self) -> nn.Module:
        return make_model()

    def rollout_step(self, env_ret: Any) -> dict[str, Any]:
        obs = torch.as_tensor(env_ret, dtype=torch.float32).reshape(-1, OBS_DIM).to(self.device)
        logits = self.model(obs).cpu()
        return {
            "action": int(logits.argmax(-1)[0]),
            "logits": logits[0].tolist(),
            "version": self.get_weight_version(),
            "worker": self.index,
            "pid": os.getpid(),
            "node": self._get_node_id(),
        }

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        assert self.optimizer is not None
        g = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        x = torch.randn(16, OBS_DIM, generator=g).to(self.device)
        target = torch.randn(16, ACTIONS, generator=g).to(self.device)
        self.optimizer.zero_grad()
        loss = ((self.model(x) - target) ** 2).mean()
        loss.backward()
        self.allreduce_gradients()
        self.optimizer.step()
        return {"loss": float(loss.detach())}

    # test hooks
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)  # a busy task (the TaskSubmitter tests)
        return seconds

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def collective_sum(self, value: float) -> tuple[int, int, float]:
        """(rank, world size, sum of every member's `value`) over the `init_collective` group."""
        group = self.model_update_group
        total = torch.tensor([float(value)])
        dist.all_reduce(total, group=group)
        return group.rank(), group.size(), float(total)

    def segment_exists(self, name: str) -> bool:
        return os.path.exists(os.path.join("/dev/shm", name))


class FaultyMLPPolicy(MLPPolicy):
    """MLPPolicy that, once armed, SIGKILLs a process (itself by default) right after the first
    bucket of a version lands in its endpoint through a CUDA IPC channel: mid-step."""

    _victim: int | None = None

    def get_pid(self) -> int:
        return os.getpid()

    def arm_kill_after_first_bucket(self, pid: int | None = None) -> None:
        self._victim = os.getpid() if pid is None else int(pid)

    def recv_ipc(self, channel: str, index: int, version: int, timeout_s: float) -> int:
        victim, self._victim = self._victim, None
        consumer = self._weights.require_endpoint().consumer
        if victim is not None and consumer is not None:
            original = consumer.consume

            def consume(k: int, data: torch.Tensor) -> None:
                original(k, data)
                os.kill(victim, signal.SIGKILL)
                if victim == os.getpid():
                    time.sleep(60)  # the SIGKILL lands meanwhile: nothing after this bucket runs

            consumer.consume = consume  # type: ignore[method-assign]
            try:
                return super().recv_ipc(channel, index, version, timeout_s)
            finally:
                consumer.consume = original  # type: ignore[method-assign]
        return super().recv_ipc(channel, index, version, timeout_s)


class NoopPolicy(BasePolicy):
    """No model work at all: measures the group's own overhead."""

    def build_model(self) -> nn.Module:
        return nn.Linear(1, 1)

    def rollout_step(self, env_ret: Any) -> Any:
        return env_ret

    def rollout_many_step(self, env_rets: list[Any]) -> list[Any]:
        return env_rets

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        return {}
