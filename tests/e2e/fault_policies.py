"""A policy with fault hooks for the e2e fault suite (pickled by value into Ray workers).

`arm(point, action, arg)` makes the worker misbehave once, the next time it reaches `point`:

- points: "consume" (right after it took a received bucket: mid-transfer), "stage" / "recv" /
  "send" / "publish" / "apply" (entry of those weight-sync calls), "join" (entry
  of `init_distributed_env`);
- actions: "die" (SIGKILL itself), "kill" (SIGKILL pid `arg`: a receiver kills its sender
  between two buckets), "hang" (block until `release()` or `arg` seconds, then fail),
  "corrupt" (at "stage" only: flip one byte of the node's shared buffer before reading it).

`mutate(kind)` rebuilds the model with one parameter renamed, reshaped or of another dtype.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn

from rlfleet.policygroup import BasePolicy

OBS_DIM = 8
ACTIONS = 4


def make_model(mutation: str | None = None) -> nn.Module:
    torch.manual_seed(1234)  # every worker starts from the same weights
    model = nn.Sequential(
        nn.Linear(OBS_DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, ACTIONS)
    )
    if mutation == "renamed":  # "2.bias" becomes "2.offset"
        layer = model[2]
        bias = layer.bias
        del layer._parameters["bias"]
        layer.register_parameter("offset", bias)
    elif mutation == "reshaped":  # "2.weight" is 32 x 33 instead of 32 x 32
        model[2].weight = nn.Parameter(torch.zeros(32, 33))
    elif mutation == "dtype":  # "2.weight" is float64
        model[2].weight = nn.Parameter(model[2].weight.detach().double())
    elif mutation is not None:
        raise ValueError(f"unknown mutation {mutation!r}")
    return model


#: The parameter each mutation touches, as the layout names it.
MUTATED_PARAMETER = {"renamed": "2.bias", "reshaped": "2.weight", "dtype": "2.weight"}


class FaultPolicy(BasePolicy):
    """A small MLP policy that can be told to die, kill a peer or hang at a chosen point."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._mutation: str | None = None
        self._faults: dict[str, tuple[str, Any]] = {}
        self._release = threading.Event()
        self._last_error: tuple[str, str, float] | None = None
        super().__init__(*args, **kwargs)

    def build_model(self) -> nn.Module:
        return make_model(self._mutation)

    def rollout_step(self, env_ret: Any) -> dict[str, Any]:
        obs = torch.as_tensor(env_ret, dtype=torch.float32).reshape(-1, OBS_DIM)
        logits = self.model(obs)
        return {
            "logits": logits[0].tolist(),
            "version": self.get_weight_version(),
            "worker": self.index,
            "pid": os.getpid(),
        }

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        assert self.optimizer is not None
        g = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        x = torch.randn(16, OBS_DIM, generator=g)
        target = torch.randn(16, ACTIONS, generator=g)
        self.optimizer.zero_grad()
        loss = ((self.model(x) - target) ** 2).mean()
        loss.backward()
        self.allreduce_gradients()
        self.optimizer.step()
        return {"loss": float(loss.detach())}

    # -- test hooks -------------------------------------------------------------------------
    def get_pid(self) -> int:
        return os.getpid()

    def get_store_port(self) -> int | None:
        """Port of the rendezvous TCPStore this worker hosts (rank 0 of a world), if any."""
        return self._comm.store_port

    def crash(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def last_error(self) -> tuple[str, str, float] | None:
        """(type, message, seconds the call ran) of the last failed receive on this worker."""
        return self._last_error

    def forget_last_error(self) -> None:
        self._last_error = None

    def _recording(self, fn: Any) -> Any:
        start = time.monotonic()
        try:
            return fn()
        except BaseException as exc:
            self._last_error = (type(exc).__name__, str(exc), time.monotonic() - start)
            raise

    def mutate(self, kind: str | None, rederive: bool = True) -> None:
        """Swap in a model whose layout differs from the others' in one parameter.

        `rederive=False` swaps it under the worker: what it derived from the old model (its
        send layout, its senders) stays, as when user code replaces a module between syncs.
        """
        self._mutation = kind
        self.model = make_model(kind)
        if rederive:
            self._weights.sender_layout = None
            self._comm.forget_broadcasts()
        if self.optimizer is not None:
            self.optimizer = self.build_optimizer(self.train_config)

    def arm(self, point: str, action: str, arg: Any = None) -> None:
        self._release.clear()
        self._faults[point] = (action, arg)

    def release(self) -> None:
        self._faults.clear()
        self._release.set()

    def _fire(self, point: str) -> None:
        fault = self._faults.pop(point, None)
        if fault is None:
            return
        action, arg = fault
        if action == "die":
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)  # the SIGKILL lands meanwhile: nothing after the fault point runs
        elif action == "kill":
            os.kill(int(arg), signal.SIGKILL)
        elif action == "hang":  # then fail: a late call must not touch what came after it
            self._release.wait(float(arg or 600.0))
            raise RuntimeError(f"fault hook at {point!r} released after hanging")

    def _hook_consumers(self) -> None:
        """Fire "consume" after the first bucket a buffer takes (any strategy, any transport)."""
        if "consume" not in self._faults:
            return
        for consumer in self._weights.consumers():
            if "consume" in vars(consumer):
                continue
            original = consumer.consume

            def consume(index: int, data: torch.Tensor, original: Any = original) -> None:
                original(index, data)
                self._fire("consume")

            consumer.consume = consume  # type: ignore[method-assign]

    # weight-sync entry points, each with its fault point
    def stage_from_segment(self, name: str, version: int, *deps: Any, timeout_s: float | None = None) -> int:
        if self._faults.get("stage", ("",))[0] == "corrupt":
            del self._faults["stage"]
            self._corrupt_segment(name, version)
        self._fire("stage")
        self._hook_consumers()
        return int(
            self._recording(
                lambda: super(FaultPolicy, self).stage_from_segment(name, version, timeout_s=timeout_s)
            )
        )

    def _corrupt_segment(self, name: str, version: int) -> None:
        """Flip one byte of the first tensor of `version` in the node's shared buffer `name`
        (its writer committed it: this call only runs once the writer's publish returned)."""
        from rlfleet.weightsync import SharedSegment, bucket_starts
        from rlfleet.weightsync.shm._shared_format import G_DATA_OFFSET, G_SLOT_BYTES, SlotTable

        layout = self._weights.require_endpoint().layout
        segment = SharedSegment.attach(name)
        try:
            header, _, _ = SlotTable.of(segment)
            slot = header.slot_holding(version)
            assert slot is not None, f"version {version} is not in {name}"
            first = layout.tensors[0]
            start = bucket_starts(layout)[first.bucket]
            pos = header.get(G_DATA_OFFSET) + slot * header.get(G_SLOT_BYTES) + start + first.offset
            data = segment.tensor(pos, 1)
            data[0] ^= 0x40
            del data, header
        finally:
            segment.close()

    def recv_broadcast(self, parts: Any, version: int, timeout_s: float) -> Any:
        self._fire("recv")
        self._hook_consumers()
        return self._recording(lambda: super(FaultPolicy, self).recv_broadcast(parts, version, timeout_s))

    def recv_ipc(self, channel: str, index: int, version: int, timeout_s: float) -> int:
        self._fire("recv")
        self._hook_consumers()
        receive = super().recv_ipc
        return int(self._recording(lambda: receive(channel, index, version, timeout_s)))

    def send_ipc(self, channel: str, version: int, timeout_s: float) -> int:
        self._fire("send")
        return super().send_ipc(channel, version, timeout_s)

    def send_broadcast(
        self, group_id: str, version: int, bucket_bytes: int, timeout_s: float, **kw: Any
    ) -> int:
        self._fire("send")
        return super().send_broadcast(group_id, version, bucket_bytes, timeout_s, **kw)

    def publish_shared(self, version: int, timeout_s: float) -> int:
        self._fire("publish")
        return super().publish_shared(version, timeout_s)

    def apply_staged(
        self, version: int | None = None, timeout_s: float | None = None, group_id: str | None = None
    ) -> int:
        self._fire("apply")
        return super().apply_staged(version, timeout_s, group_id)

    def init_distributed_env(self, *args: Any, **kwargs: Any) -> int:
        self._fire("join")
        return super().init_distributed_env(*args, **kwargs)


def zeros_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def ring_reader_process(name: str, queue: Any, go: Any) -> None:
    """A reader process: attach to ring `name` as reader 0, say so, wait for `go`, receive one
    version into a DoubleBuffer over zeroed weights; report (error, message, version, checksum)."""
    from rlfleet.weightsync import DoubleBuffer, Layout, ShmRingReceiver, checksum

    live = zeros_like(make_model().state_dict())
    buffer = DoubleBuffer(live, Layout.from_state_dict(live, 1 << 20))
    receiver = ShmRingReceiver.attach(name, 0)
    queue.put("attached")
    go.wait(120)
    kind, message = "ok", ""
    try:
        receiver.receive(buffer, 30.0)
    except Exception as exc:
        kind, message = type(exc).__name__, str(exc)
    finally:
        receiver.close()
    queue.put((kind, message, buffer.version, checksum(live)))
