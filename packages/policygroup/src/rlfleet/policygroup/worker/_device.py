"""Device introspection and profiling for a worker (NeMo RL's device calls), on CPU and CUDA.

What the worker's device is and holds (the caller says which node it is on: only the cluster
layer knows), a torch profiler that starts and stops on one thread of its own (a Ray actor serves calls on
many threads, and the profiler must stop on the thread that started it), and call timings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import platform
import socket
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, page * os.sysconf("SC_AVPHYS_PAGES")


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def device_id(device: torch.device, node_id: str = "local") -> str:
    """ "GPU-<uuid>" of a CUDA device, "CPU-<host>-<node>" otherwise."""
    if device.type == "cuda":
        uuid = str(torch.cuda.get_device_properties(_cuda_index(device)).uuid)
        return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    return f"CPU-{socket.gethostname()}-{node_id[:12]}"


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_memory()[1]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_info(device: torch.device, model_bytes: int, node_id: str = "local") -> dict[str, Any]:
    """What the device is, holds and has free (`model_bytes`: the model's size on a CPU)."""
    common = {"uuid": device_id(device, node_id), "node_id": node_id, "pid": os.getpid()}
    if device.type == "cuda":
        idx = _cuda_index(device)
        props = torch.cuda.get_device_properties(idx)
        free, total = torch.cuda.mem_get_info(idx)
        return {
            "device": f"cuda:{idx}",
            "name": props.name,
            "total_memory": int(total),
            "free_memory": int(free),
            "memory_allocated": int(torch.cuda.memory_allocated(idx)),
            "max_memory_allocated": int(torch.cuda.max_memory_allocated(idx)),
            "compute_capability": f"{props.major}.{props.minor}",
            **common,
        }
    total, free = host_memory()
    return {
        "device": "cpu",
        "name": platform.processor() or platform.machine(),
        "total_memory": total,
        "free_memory": free,
        "memory_allocated": model_bytes,
        "num_threads": torch.get_num_threads(),
        **common,
    }


class Profiler:
    """The torch profiler (CPU, plus CUDA on a GPU), driven from one thread of its own."""

    def __init__(self) -> None:
        self._profile: Any = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._dir: str | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def _run(self, fn: Any, timeout: float) -> None:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "rlfleet-profiler")
        self._thread.submit(fn).result(timeout=timeout)

    def start(self, device: torch.device, trace_dir: str | None = None) -> None:
        if self._profile is not None:
            raise RuntimeError("profiling is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._dir = trace_dir or tempfile.mkdtemp(prefix="rlfleet-profile-")
        profile = torch.profiler.profile(activities=activities, record_shapes=False)
        self._run(profile.__enter__, 60)
        self._profile = profile

    def stop(self, name: str) -> str | None:
        """Stop and write a Chrome trace `<name>-<pid>.json`; its path (None if not running)."""
        profile, self._profile = self._profile, None
        if profile is None:
            return None
        assert self._dir is not None
        path = os.path.join(self._dir, f"{name}-{os.getpid()}.json")

        def stop() -> None:
            profile.__exit__(None, None, None)
            profile.export_chrome_trace(path)

        self._run(stop, 120)
        return path


class Timings:
    """Count and total seconds of each kind of call (the seed's `print_timing_summary`)."""

    def __init__(self) -> None:
        self._entries: dict[str, list[float]] = {}

    def add(self, name: str, start: float) -> None:
        """One call of `name` that started at `start` (``time.perf_counter()``) ended now."""
        entry = self._entries.setdefault(name, [0.0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - start

    @contextlib.contextmanager
    def measure(self, name: str) -> Iterator[None]:
        """Count the block as one call of `name`, however it ends (a raised error included)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start)

    def summary(self, who: str, reset: bool = False) -> dict[str, dict[str, float]]:
        """Print and return count, total and mean seconds by name; `reset` starts counting anew."""
        out = {
            n: {"count": c, "total_s": t, "mean_s": t / c if c else 0.0}
            for n, (c, t) in sorted(self._entries.items())
        }
        for n, e in out.items():
            print(
                f"[{who}] {n}: n={int(e['count'])} total={e['total_s']:.4f}s mean={e['mean_s'] * 1e3:.3f}ms"
            )
        if reset:
            self._entries.clear()
        return out
