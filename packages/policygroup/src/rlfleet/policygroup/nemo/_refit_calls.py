"""NeMo RL's refit surface of a worker, as a mixin for a worker class (policygroup's `BasePolicy`).

- `_refit_transport_state(key)`: the state each refit transport keeps between calls, one
  mutable dict per key, made on first use (the seed's worker has no constructor hook). Our
  transports keep it JSON-safe: "rollout_engines" (`connect_sglang_rollout_engines`, with the
  model-update group of `init_collective` it builds on), "nccl_reshard" and "zmq".
- `connect_sglang_rollout_engines` / `refit_rollout_engines`: rollout engines, by GPU counts
  and offsets, receive each version from the trainers over one group (`EngineRefit`).
- `maybe_init_zmq` / `get_zmq_address`: the refit control channel (`RefitChannel`).
- `stand_down_refit_watchdog`: lift every refit deadline in flight in this process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from rlfleet.policygroup.nemo._engines import EngineRefit, RolloutEngines
from rlfleet.policygroup.nemo._refit_channel import RefitChannel, import_zmq
from rlfleet.policygroup.worker._host import WorkerHost
from rlfleet.weightsync import CommGroupError, stand_down_armed_watchdogs

__all__ = ["RefitCalls", "transport_state"]

DEFAULT_REFIT_TIMEOUT_S = 120.0


def transport_state(worker: Any, key: str) -> dict[str, Any]:
    """Refit transport `key`'s state dict on `worker` (the same object on every call)."""
    if not isinstance(key, str) or not key:
        raise ValueError(f"a refit transport key is a non-empty string, got {key!r}")
    states: dict[str, dict[str, Any]] = worker.__dict__.setdefault("_refit_transports", {})
    return states.setdefault(key, {})


def _part(worker: Any, name: str, make: Any) -> Any:
    """A transport's live objects (groups, sockets), kept beside its JSON-safe state."""
    part = worker.__dict__.get(name)
    if part is None:
        part = worker.__dict__[name] = make()
    return part


class RefitCalls(WorkerHost):
    """The refit calls of NeMo RL's policy worker, for a worker class to inherit (policygroup's
    `BasePolicy` does)."""

    report_device_id: Callable[[], str]  # the host's (`DeviceCalls`)

    def _refit_transport_state(self, key: str) -> dict[str, Any]:
        """Return the mutable state dict for one refit transport, e.g. "rollout_engines".

        Transports keep their bookkeeping here (groups, layouts, buffers, versions) instead of
        adding fields to the worker; made on first use, JSON-safe for ours.
        """
        return transport_state(self, key)

    def connect_sglang_rollout_engines(
        self, *, engine_gpu_counts: list[int], engine_gpu_offsets: list[int] | None = None
    ) -> None:
        """Make rollout engines, by GPU counts and offsets, the receiving side of the refit group.

        Called by every trainer rank, after `init_collective` (its store is where the engines
        meet; its ``train_world_size`` trainers are the first members). A second call with the
        same topology is a no-op unless a refit broke the group. Any engine that speaks
        weightsync's broadcast wire can join (see `RolloutEngines`).
        """
        collective = dict(self._comm.collective)
        store = getattr(self._comm, "_collective_store", None)
        if not collective or store is None:
            raise CommGroupError(
                "connect_sglang_rollout_engines: init_collective(ip, port, world_size, "
                "train_world_size=...) must come first (the engines meet on its store)"
            )
        engines = RolloutEngines.describe(
            collective["train_world_size"], engine_gpu_counts, engine_gpu_offsets
        )
        refit = _part(self, "_engine_refit", lambda: EngineRefit(transport_state(self, "rollout_engines")))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        refit.connect(engines, store, collective["rank"], backend, self.config.group_timeout_s)
        refit.state["collective"] = collective

    def refit_rollout_engines(
        self, *, version: int | None = None, refit_timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Send this trainer's weights as `version` (default: the next) to the connected engines.

        Collective over the trainers (trainer 0 sends). Raises a WeightSyncError naming what
        failed, and the engines keep their previous version; the deadline is a watchdog that
        `stand_down_refit_watchdog` lifts. Returns what moved.
        """
        refit = self.__dict__.get("_engine_refit")
        if refit is None:
            raise CommGroupError("refit_rollout_engines: connect_sglang_rollout_engines() must come first")
        weights = self._weights
        v = weights.version + 1 if version is None else int(version)
        wire = getattr(self.config.weight_buffer, "wire_dtype", None)  # what the engines serve
        layout = weights.layout_for(self.model, self.config.weight_buffer.bucket_bytes, wire)
        timeout_s = DEFAULT_REFIT_TIMEOUT_S if refit_timeout_s is None else refit_timeout_s
        moved: dict[str, Any] = refit.refit(self.model.state_dict(), layout, v, timeout_s)
        weights.version = v
        return moved

    def stand_down_refit_watchdog(self) -> int:
        """Cancel any in-flight refit deadline in this worker; returns how many.

        For the controller, once a peer is confirmed gone: its closed sockets end the waits on
        it, so the deadline has nothing left to do. Never blocks, never touches CUDA.
        """
        return stand_down_armed_watchdogs()

    def _refit_channel(self) -> RefitChannel:
        def make() -> RefitChannel:
            zmq = import_zmq()
            channel = RefitChannel(self.report_device_id(), "ipc" if zmq.has("ipc") else "tcp")
            transport_state(self, "zmq").update(channel.describe())
            return channel

        channel: RefitChannel = _part(self, "_refit_channel_socket", make)
        return channel

    def maybe_init_zmq(self) -> None:
        """Bind the refit control channel if it is not bound yet (needs ``rlfleet-policygroup[zmq]``)."""
        self._refit_channel()

    def get_zmq_address(self) -> str:
        """The refit control channel's address for this device (``ipc://`` or loopback ``tcp://``)."""
        return self._refit_channel().address

    def get_zmq_credentials(self) -> str | None:
        """Where the engine finds the keys of a loopback (``tcp://``) refit channel: a file only
        this user can read, for `connect_refit_engine`; None for an ``ipc://`` channel."""
        return self._refit_channel().credentials

    def zmq_request(self, message: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one JSON object to the engine on the refit channel; returns its JSON reply."""
        channel = self._refit_channel()
        try:
            return channel.request(message, timeout_s)
        finally:
            transport_state(self, "zmq").update(channel.describe())
