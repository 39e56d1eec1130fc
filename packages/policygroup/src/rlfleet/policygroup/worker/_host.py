"""`WorkerHost`: what the worker mixins read from the class that inherits them, and the
parts they share, made in one place.

A host class (policygroup's `BasePolicy`, or any worker object) sets `config`, `role`, `index`,
`device` and `model` in its ``__init__`` and then calls `_init_parts`. The mixins that inherit
`WorkerHost` (`StateCalls`, `ReferenceCalls`, `DeviceCalls`, `OffloadCalls`) use only what is
declared here. The hooks answer for one local node; a cluster layer overrides them with what its
scheduler knows (policygroup: Ray's node id, node address and GPU ids).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from rlfleet.policygroup.worker._checkpoints import Checkpoints
from rlfleet.policygroup.worker._comm import WorkerComm
from rlfleet.policygroup.worker._device import Profiler, Timings
from rlfleet.policygroup.worker._settings import WorkerSettings
from rlfleet.policygroup.worker._snapshots import TrainerSnapshots
from rlfleet.weightsync import ServingLock, WorkerWeights


class WorkerHost:
    """The attributes and hooks of a worker class that the worker mixins rely on."""

    # Set by the host class before `_init_parts`.
    config: WorkerSettings
    role: Any  # its ``value`` (a str enum) or itself names the worker in traces and timings
    index: int
    device: torch.device
    model: torch.nn.Module
    # Set by `_init_parts`.
    optimizer: torch.optim.Optimizer | None
    train_config: Any  # what `build_optimizer` takes (the host's training settings)
    model_update_group: Any
    pp_comm_group: Any
    _serve: ServingLock
    _comm: WorkerComm
    _weights: WorkerWeights
    _snapshots: TrainerSnapshots  # a trainer's snapshots for non-blocking syncs
    _checkpoints: Checkpoints
    _offloaded: dict[str, bool]  # "model", "optimizer", "grad": what `OffloadCalls` moved out
    _profiler: Profiler
    _timings: Timings
    _ref_model: torch.nn.Module | None
    _restarted: bool

    def _init_parts(self, restarted: bool = False) -> None:
        """Make the parts the mixins share, with the config's deadlines (once, after `model`).

        `restarted`: the process replaces one that died (the host refuses requests until its
        group connects it again).
        """
        c = self.config
        self.optimizer, self.train_config = None, None
        self.model_update_group = self.pp_comm_group = None  # the seed's: None until a group exists
        self._serve = ServingLock()  # rollouts share it; a weight swap takes it exclusively
        self._comm = WorkerComm(c.group_timeout_s)
        self._weights = WorkerWeights(
            self._serve,
            self._who,
            bucket_bytes=c.weight_buffer.bucket_bytes,
            commit_timeout_s=c.drain_timeout_s,
            attach_timeout_s=c.group_timeout_s,
            write_timeout_s=c.sync_timeout_s,
        )
        self._snapshots = TrainerSnapshots(self._who)
        self._checkpoints = Checkpoints()
        self._offloaded = dict.fromkeys(("model", "optimizer", "grad"), False)
        self._profiler = Profiler()
        self._timings = Timings()
        self._ref_model = None  # the frozen reference copy, made at first use
        self._restarted = restarted

    # -- hooks ------------------------------------------------------------------------------
    def build_optimizer(self, train_config: Any) -> torch.optim.Optimizer:
        """The optimizer of `model` for `train_config` (the host's training settings)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_optimizer(train_config)")

    def _tag(self) -> str:
        """The worker's short name in traces and timings ("eval0")."""
        return f"{getattr(self.role, 'value', self.role)}{self.index}"

    def _who(self) -> str:
        """The worker's name in error messages."""
        return f"worker {self._tag()}"

    def _node_ip(self) -> str:
        """This node's address."""
        return "127.0.0.1"

    def _get_node_id(self) -> str:
        """This node's id (in a device's CPU id and in `get_gpu_info`)."""
        return "local"

    def _get_gpu_ids(self) -> list[int]:
        """The GPUs this process was given."""
        return [0]

    # -- lifecycle --------------------------------------------------------------------------
    def release_weight_buffers(self) -> int:
        """Leave the node's buffer, unlinking it if this worker wrote it; returns how many unlinked."""
        self._snapshots.release()
        return self._weights.release()

    def shutdown(self) -> bool:
        """Finish a background checkpoint, stop profiling, leave the node buffer and the groups."""
        with contextlib.suppress(Exception):
            self._checkpoints.finalize()
        self._profiler.stop(self._tag())
        self.release_weight_buffers()
        self._comm.destroy()
        self.model_update_group = None
        return True
