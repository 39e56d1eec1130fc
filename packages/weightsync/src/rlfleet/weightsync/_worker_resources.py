"""A worker's device calls (NeMo RL's: device facts, profiling) and offload calls (the seed's), for
a worker class to inherit.

Device facts name the node through the host's `_get_node_id` hook (only the cluster layer knows
it); offload keeps a module bound to its node's shared buffer ("Shared") where it is.
"""

from __future__ import annotations

from typing import Any

from rlfleet.weightsync._worker_base import WorkerHost
from rlfleet.weightsync._worker_device import device_id, device_info, free_memory, reset_peak_memory


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
    """Offload and reload of the model, its gradients and the optimizer state (`Offload`)."""

    def _bound_to_node_buffer(self) -> bool:
        endpoint = self._weights.endpoint
        return endpoint is not None and endpoint.strategy == "Shared"

    def offload_model(self) -> None:
        """Rollout worker: move the model to host memory (a no-op move on CPU)."""
        self._offload.model(self.model, True, self._bound_to_node_buffer())

    def reload_model(self) -> None:
        self._offload.model(self.model, False, self._bound_to_node_buffer())

    def offload_optimizer(self) -> None:
        self._offload.optimizer(self.optimizer, True)

    def reload_optimizer(self) -> None:
        self._offload.optimizer(self.optimizer, False)

    def offload_model_param_and_grad(self, offload_grad: bool = True) -> None:
        self._offload.params_and_grads(self.model, True, offload_grad)

    def reload_model_param_and_grad(self, load_grad: bool = True) -> None:
        self._offload.params_and_grads(self.model, False, load_grad)

    def get_offload_state(self) -> dict[str, bool]:
        return self._offload.state()
