"""The soak's policy, pickled by value into its Ray actors: a small MLP that can be armed to
SIGKILL itself at a point of a sync, kill its node buffer's writer mid-publish, or refuse a
commit (see `soak.py`)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

from rlfleet.policygroup import BasePolicy
from rlfleet.weightsync import SyncTimeoutError

OBS_DIM = 8
SYNC_TIMEOUT_S = 10.0
RPC_TIMEOUT_S = 20.0
DRAIN_TIMEOUT_S = 3.0  # a rolling update waits this long for a worker's requests, then gives up
SLOW_REQUEST_S = DRAIN_TIMEOUT_S + 2.0  # a request that outlasts the drain (fault "slow_request")
GROUP_TIMEOUT_S = 10.0
KIND = {"None": "WeightBuffer", "Double": "WeightBuffer", "Shared": "CPUWeightBuffer"}
PLACES = {
    "train0": "node0",
    "train1": "node0",  # the second sender of the "Mixed" phase: node1's workers get two shares
    "eval0": "node0",
    "eval1": "node0",
    "eval2": "node1",
    "eval3": "node1",
}
#: Each phase: (buffer strategy, trainers, cuda_ipc). "IPC": node0's readers over the CUDA IPC
#: channel in host mode; "Mixed": two trainers, each sending its share of every version.
PHASES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "Double": ("Double", ("train0",), "auto"),
    "Shared": ("Shared", ("train0",), "auto"),
    "None": ("None", ("train0",), "auto"),
    "IPC": ("Double", ("train0",), "host"),
    "Mixed": ("Double", ("train0", "train1"), "auto"),
}
KILLABLE = ("eval1", "eval2", "eval3")
FAULT_POINTS = ("consume", "stage", "apply", "timer")
TRAINER_FAULTS = ("writer_publish", "trainer_sigterm")
#: The group calls that wire a new policy group, in order (after `init`), with their arguments.
WIRING = (
    ("init_placement_info", ()),
    ("init_weight_buffer", ()),
    ("init_comm_group", ("gloo",)),
    ("sync_weights", ()),
)


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ the policy (pickled by value)
class SoakPolicy(BasePolicy):
    """A small MLP; `arm(point)` makes it SIGKILL itself the next time it reaches `point`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._armed: str | None = None
        super().__init__(*args, **kwargs)

    def build_model(self) -> nn.Module:
        torch.manual_seed(1234)
        return nn.Sequential(
            nn.Linear(OBS_DIM, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
        )

    def rollout_step(self, env_ret: Any) -> dict[str, Any]:
        if self._armed == "slow_request":  # holds the serving lock past the drain's deadline
            self._armed = None
            time.sleep(SLOW_REQUEST_S)
        logits = self.model(torch.as_tensor(env_ret, dtype=torch.float32)[None])[0]
        return {"logits": logits.tolist(), "version": self.get_weight_version(), "worker": self.index}

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        assert self.optimizer is not None
        g = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        x, y = torch.randn(16, OBS_DIM, generator=g), torch.randn(16, 4, generator=g)
        self.optimizer.zero_grad()
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.optimizer.step()
        return {"loss": float(loss.detach())}

    def get_pid(self) -> int:
        return os.getpid()

    def arm(self, point: str | None) -> None:
        self._armed = point

    def _maybe_die(self, point: str) -> None:
        if self._armed == point:
            os.kill(os.getpid(), signal.SIGKILL)

    def publish_into_newest_then_die(self, unread: int, doomed: int) -> None:
        """Trainer, writer of its node's buffer: publish `unread` (the node's readers do not take
        it), then publish `doomed` and die mid-publish: SIGKILLed before its commit, or while it
        waits for a slot (a timer)."""
        writer = self.weights.node_writer
        assert writer is not None, "not the writer of a node buffer"
        state = self.model.state_dict()
        writer.publish(state, unread, SYNC_TIMEOUT_S)

        def die(version: int) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        writer.commit = die  # type: ignore[method-assign]
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGKILL)).start()
        writer.publish(state, doomed, 4 * SYNC_TIMEOUT_S)

    def _refuse_next_prepare(self) -> None:
        """The commit-fault hook: this eval's buffer cannot ready the next commit (as a serving
        lock that cannot be taken); the sync must fail on every rank, the old version kept."""
        endpoint = self.weights.endpoint
        buffer = None if endpoint is None else endpoint.consumer
        if buffer is None or "_prepare" in vars(buffer):
            return

        def refuse(version: int, deadline: Any) -> None:
            del buffer._prepare  # type: ignore[attr-defined]
            self._armed = None
            raise SyncTimeoutError(f"soak fault: the serving lock for version {version} was not acquired")

        buffer._prepare = refuse  # type: ignore[method-assign]

    def _hook(self) -> None:
        if self._armed == "commit":
            self._refuse_next_prepare()
        if self._armed != "consume":
            return
        for consumer in self.weights.consumers():
            if "consume" not in vars(consumer):
                original = consumer.consume

                def consume(index: int, data: torch.Tensor, original: Any = original) -> None:
                    original(index, data)
                    self._maybe_die("consume")

                consumer.consume = consume  # type: ignore[method-assign]

    def stage_from_segment(self, name: str, version: int, *deps: Any, timeout_s: float | None = None) -> int:
        self._maybe_die("stage")
        self._hook()
        return super().stage_from_segment(name, version, *deps, timeout_s=timeout_s)

    def recv_broadcast(self, parts: Any, version: int, timeout_s: float) -> Any:
        self._maybe_die("stage")
        self._hook()
        return super().recv_broadcast(parts, version, timeout_s)

    def recv_ipc(self, channel: str, index: int, version: int, timeout_s: float) -> int:
        self._maybe_die("stage")
        self._hook()
        return super().recv_ipc(channel, index, version, timeout_s)

    def send_broadcast(
        self, group_id: str, version: int, bucket_bytes: int, timeout_s: float, **kw: Any
    ) -> int:
        """The "mixed" fault: this sender announces the next version for its share of this one
        (as a trainer a step ahead of the others would); receivers must commit nothing."""
        if self._armed == "mixed":
            self._armed = None
            version += 1
        return super().send_broadcast(group_id, version, bucket_bytes, timeout_s, **kw)

    def apply_staged(
        self, version: int | None = None, timeout_s: float | None = None, group_id: str | None = None
    ) -> int:
        self._maybe_die("apply")
        return super().apply_staged(version, timeout_s, group_id)
