"""A worker's weights and training state as data: inspection, copies, checkpoints (the seed's and
NeMo RL's calls, for a worker class to inherit).

A training state (model and optimizer state, and the host's training settings) copied to a second
worker makes it a replica in step: its next optimizer step is the same. A checkpoint is the
same state plus the weight version, written whole or not at all (`Checkpoints`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from rlfleet.policygroup.worker._host import WorkerHost
from rlfleet.weightsync import DTYPES, Layout, checksum, fingerprint


class StateCalls(WorkerHost):
    """Weights inspection, training state and checkpoints of a worker (`WorkerHost` says what it reads)."""

    # ================================================================== inspection
    def _served(self) -> Mapping[str, torch.Tensor]:
        """The weights as rollout workers serve them: floating tensors in the config's wire dtype
        (a trainer's fp32 cast; a rollout worker's already are), so the checks compare like with like."""
        state = self.model.state_dict()
        wire = getattr(self.config.weight_buffer, "wire_dtype", None)
        if wire is None:
            return state
        dtype = DTYPES[wire]
        return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}

    def get_param_fingerprint(self) -> dict[str, float]:
        return fingerprint(self._served())

    def get_weight_checksum(self) -> str:
        return checksum(self._served())

    def get_weight_version(self) -> int:
        return self._weights.version

    def set_weight_version(self, version: int) -> None:
        self._weights.version = int(version)

    def get_weight_layout(self, bucket_bytes: int) -> dict[str, Any]:
        wire = getattr(self.config.weight_buffer, "wire_dtype", None)
        return Layout.from_state_dict(self.model.state_dict(), bucket_bytes, wire_dtype=wire).to_dict()

    # ================================================================== state as data
    def get_state_dict(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the model's state (independent of later updates)."""
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy `state` into the model's tensors in place (bound buffers stay bound)."""
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(state[name])

    def _optimizer_state(self) -> dict[str, Any] | None:
        return copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None

    def get_training_state(self) -> dict[str, Any]:
        """Model and optimizer state (to start a new data-parallel trainer exactly in step)."""
        return {
            "model": self.get_state_dict(),
            "optimizer": self._optimizer_state(),
            "train_config": self.train_config,
        }

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        """Become a replica of the trainer `state` came from (role must be train already)."""
        self.load_state_dict(state["model"])
        self.train_config = state.get("train_config", self.train_config)
        self.optimizer = self.build_optimizer(self.train_config)
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._ref_model = None

    # ================================================================== checkpoints
    def save_checkpoint(self, path: str, async_save: bool = False) -> str:
        """Write model (+ optimizer) state to `path`; with `async_save` in a background thread."""
        state = {
            "model": self.get_state_dict(),
            "optimizer": self._optimizer_state(),
            "version": self._weights.version,
        }
        return self._checkpoints.save(state, path, async_save)

    def load_checkpoint(self, path: str) -> int:
        """Load a checkpoint's model (and, given an optimizer, its state); returns its version."""
        state = self._checkpoints.load(path)
        self.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        return int(state.get("version", 0))

    def finalize_async_save(self, timeout: float = 600.0) -> None:
        self._checkpoints.finalize(timeout)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self.finalize_async_save()
