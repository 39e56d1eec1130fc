"""The worker-level IPC channel check of `gpu_check.py`: policygroup's same-node GPU path, no Ray.

A sync plan's "cuda_ipc" step runs `WorkerWeights.ipc_channel` / `ipc_send` on the writer and
`ipc_receive` + `apply` on each same-node reader (policygroup's `sync_ipc_*` calls only wrap
them). Here one writer and two readers, a "Double" endpoint and a "None" endpoint, each a
spawned process holding a module built from the check's model spec:

  versions 1..R+2   one channel, kept across versions; readers check v1 and v(R+2) bit for bit
                    against a fresh copy; the writer times v3..v(R+2) (v2 pays for v1's check);
  version R+3       fails on the writer before any byte moves (a reshaped parameter): the
                    writer closes the channel, each reader fails at once (PeerLostError),
                    leaves it and keeps v(R+2), bit for bit;
  version R+4       goes through a new channel; bit for bit again.

Every body returns a JSON-safe dict; `gpu_check.py` turns them into claims.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from _gpu_check_parts import _publish_name, _seed, _spec, _wait_for_file, mismatched
from _state import Spec, build_state

READERS = ("Double", "None")  # reader index i has endpoint READERS[i]


def build_module(spec: Spec, device: str) -> Any:
    """A module whose state dict is `spec` (zeros): floats as parameters, integers as buffers."""
    import torch

    root = torch.nn.Module()
    for name, tensor in build_state(spec, fill=False, device=device).items():
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        if tensor.is_floating_point():
            parent.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            parent.register_buffer(leaf, tensor)
    return root


def _load(module: Any, state: Mapping[str, Any]) -> None:
    """Write a version into the module in place (a trainer's optimizer step, in effect)."""
    import torch

    with torch.no_grad():
        for name, tensor in module.state_dict().items():
            tensor.copy_(state[name])


def _sync_device(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _error(exc: BaseException) -> dict[str, Any]:
    return {"type": type(exc).__name__, "message": " ".join(str(exc).split())[:200]}


def channel_writer(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The trainer-like writer: see the module docstring. Seconds per timed send."""
    import torch

    from rlfleet.weightsync import Deadline, ServingLock, WeightSyncError, WorkerWeights

    device, reps, bucket = cfg["device"], cfg["reps"], cfg["bucket_bytes"]
    backend, readers = cfg["backend"], [f"reader-{strategy}" for strategy in READERS]
    if device == "cuda":
        torch.cuda.set_device(0)
    spec = _spec(cfg)
    states = {seed: build_state(spec, seed=seed, device=device) for seed in (1, 2)}
    module = build_module(spec, device)
    weights = WorkerWeights(ServingLock(), lambda: "gpu_check writer", bucket_bytes=bucket)
    name = weights.ipc_channel(module, readers, backend, bucket)
    _publish_name(cfg["path"], name)
    nbytes = weights.layout_for(module, bucket).total_bytes
    out: dict[str, Any] = {"times": [], "reused": True, "tensor_bytes": nbytes}
    for version in range(1, reps + 3):
        _load(module, states[_seed(version)])
        out["reused"] &= weights.ipc_channel(module, readers, backend, bucket) == name
        _sync_device(device)
        start = time.perf_counter()
        weights.ipc_send(module, name, version, Deadline(cfg["deadline"]))
        if version >= 3:
            out["times"].append(time.perf_counter() - start)
    first = next(n for n, p in module.named_parameters() if p.dim() == 2)
    owner, leaf = module.get_submodule(first.rpartition(".")[0]), first.rpartition(".")[2]
    kept = getattr(owner, leaf)
    reshaped = kept.detach()[: max(1, kept.shape[0] // 2)]
    setattr(owner, leaf, torch.nn.Parameter(reshaped, requires_grad=False))
    try:
        weights.ipc_send(module, name, reps + 3, Deadline(cfg["deadline"]))
        out["failed"] = {"type": "no error", "message": ""}
    except WeightSyncError as exc:  # the reshaped parameter no longer fits the channel's layout
        out["failed"] = _error(exc)
    out["closed"] = weights.ipc_writer.name is None
    setattr(owner, leaf, kept)
    _load(module, states[_seed(reps + 4)])
    fresh = weights.ipc_channel(module, readers, backend, bucket)
    out["new_channel"] = fresh != name
    _publish_name(cfg["path"] + ".next", fresh)
    weights.ipc_send(module, fresh, reps + 4, Deadline(cfg["deadline"]))
    weights.release()
    return out


def channel_reader(cfg: Mapping[str, Any], index: int) -> dict[str, Any]:
    """Reader `index` of the channel, through a `READERS[index]` endpoint: see the module docstring."""
    import torch

    from rlfleet.weightsync import Deadline, ServingLock, WeightSyncError, WorkerWeights

    device, reps, bucket = cfg["device"], cfg["reps"], cfg["bucket_bytes"]
    if device == "cuda":
        torch.cuda.set_device(0)
    spec = _spec(cfg)
    module = build_module(spec, "cuda:0" if device == "cuda" else device)
    weights = WorkerWeights(ServingLock(), lambda: f"gpu_check reader {index}", bucket_bytes=bucket)
    layout = weights.layout_for(module, bucket).to_dict()
    endpoint = weights.init_endpoint(module, READERS[index], None, layout)

    def take(name: str, version: int) -> None:
        weights.ipc_receive(module, name, index, version, Deadline(cfg["deadline"]))
        endpoint.apply(version)

    def exact(version: int) -> bool:
        _sync_device(device)
        return endpoint.version == version and not mismatched(module.state_dict(), spec, version, device)

    out: dict[str, Any] = {}
    name = _wait_for_file(cfg["path"])
    take(name, 1)
    out["first_exact"] = exact(1)
    for version in range(2, reps + 3):
        take(name, version)
    out["last_exact"] = exact(reps + 2)
    start = time.monotonic()
    try:
        take(name, reps + 3)
        out["failed"] = {"type": "no error", "message": ""}
    except WeightSyncError as exc:  # PeerLostError expected: the claim checks the type
        out["failed"] = _error(exc)
    out["failed"]["seconds"] = round(time.monotonic() - start, 3)
    out["kept_exact"] = exact(reps + 2)
    out["left"] = weights.ipc_reader.name is None
    take(_wait_for_file(cfg["path"] + ".next"), reps + 4)
    out["next_exact"] = exact(reps + 4)
    weights.release()
    return out


def channel_double(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return channel_reader(cfg, 0)


def channel_none(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return channel_reader(cfg, 1)
