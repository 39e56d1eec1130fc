"""A worker's device calls (NeMo RL's: device facts, profiling) and offload calls (the seed's), for
a worker class to inherit.

Device facts name the node through the host's `_get_node_id` hook (only the cluster layer knows
it); offload is weightsync's storage-level offload, the one the GPU check exercises.
"""

from __future__ import annotations

from typing import Any

import torch

from rlfleet.policygroup.worker._device import device_id, device_info, free_memory, reset_peak_memory
from rlfleet.policygroup.worker._host import WorkerHost
from rlfleet.weightsync import offload_module, offload_optimizer, reload_module, reload_optimizer


class DeviceCalls(WorkerHost):
    """What the worker's device is and holds, its profiler and its call timings."""

    def is_alive(self) -> bool:
        return True

    def reset_peak_memory_stats(self) -> None:
        reset_peak_memory(self.device)

    def get_gpu_info(self) -> dict[str, Any]:
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return device_info(self.device, model_bytes, self._get_node_id())

    def report_device_id(self) -> str:
        return device_id(self.device, self._get_node_id())

    def get_free_memory_bytes(self) -> int:
        return free_memory(self.device)

    def report_node_ip_and_gpu_id(self) -> tuple[str, int]:
        return self._node_ip(), self._get_gpu_ids()[0] if self.device.type == "cuda" else -1

    def start_gpu_profiling(self, trace_dir: str | None = None) -> None:
        """Start the torch profiler (CPU, plus CUDA when on a GPU)."""
        self._profiler.start(self.device, trace_dir)

    def stop_gpu_profiling(self) -> str | None:
        """Stop the profiler; returns the path of the Chrome trace written (None if not running)."""
        return self._profiler.stop(self._tag())

    def print_timing_summary(self, reset: bool = False) -> dict[str, dict[str, float]]:
        return self._timings.summary(self._tag(), reset)


class OffloadCalls(WorkerHost):
    """Offload and reload of the model, its gradients and the optimizer state (the seed's calls).

    On a GPU worker they move storages to pinned host memory and back, bit-exact, with
    weightsync's `offload_module` / `offload_optimizer`: every alias (the optimizer's parameters,
    tied weights) sees the same bytes again, and touching an offloaded tensor raises instead of
    reading stale values. On a CPU worker there is no device memory to free: the calls only
    record the state. A module bound to its node's buffer ("Shared") holds no private storage:
    offload skips it.
    """

    def _move(self, owner: torch.nn.Module | torch.optim.Optimizer | None, to_host: bool, **kw: Any) -> None:
        if owner is None or self.device.type == "cpu":
            return
        if isinstance(owner, torch.nn.Module):
            if to_host:
                offload_module(owner, "cpu", empty_cache=True, **kw)
            else:
                reload_module(owner)
        elif to_host:
            offload_optimizer(owner, "cpu", empty_cache=True)
        else:
            reload_optimizer(owner)

    def offload_model(self) -> None:
        """Rollout worker: move the model's parameters and buffers to host memory."""
        self._move(self.model, True, grads=False)
        self._offloaded["model"] = True

    def reload_model(self) -> None:
        self._move(self.model, False)
        self._offloaded["model"] = False

    def offload_optimizer(self) -> None:
        self._move(self.optimizer, True)
        self._offloaded["optimizer"] = True

    def reload_optimizer(self) -> None:
        self._move(self.optimizer, False)
        self._offloaded["optimizer"] = False

    def offload_model_param_and_grad(self, offload_grad: bool = True) -> None:
        """Trainer: move the parameters (and, with `offload_grad`, their gradients) to host memory."""
        self._move(self.model, True, grads=offload_grad)
        self._offloaded.update(model=True, grad=offload_grad)

    def reload_model_param_and_grad(self, load_grad: bool = True) -> None:
        self._move(self.model, False)
        self._offloaded.update(model=False, grad=False)

    def get_offload_state(self) -> dict[str, bool]:
        """What is offloaded now: "model", "optimizer", "grad"."""
        return dict(self._offloaded)
