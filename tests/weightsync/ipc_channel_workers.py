"""Process bodies for the worker-level IPC channel tests (spawned, under `run_ranks`).

Rank 0 is a trainer-like writer, ranks 1.. its same-node readers, each a `WorkerWeights` over a
real module with a real endpoint: the code path policygroup's "cuda_ipc" step calls run
(`sync_ipc_channel`, `sync_ipc_send`, `sync_ipc_receive` are thin wrappers over these).
"""

from __future__ import annotations

from typing import Any

import torch
import weightsync_dist_workers as w
from torch import nn

from rlfleet.weightsync import Deadline, ServingLock, WorkerWeights, checksum

BUCKET_BYTES = 4096


def make_module(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Linear(64, 4)).to(device)


def set_version(module: nn.Module, version: int) -> None:
    """Weights that differ in every parameter from one version to the next."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g))


def weights_sum(module: nn.Module) -> str:
    return checksum({k: v.detach().cpu() for k, v in module.state_dict().items()})


def expected_sum(version: int) -> str:
    module = make_module("cpu")
    set_version(module, version)
    return weights_sum(module)


def scenario_ipc_channels(rank: int, world: int, port: int, path: str, backend: str, strategy: str) -> Any:
    """Versions 1-3 through one channel (reused); version 4 fails on the writer before any byte
    moves (its model no longer fits the layout): the writer closes the channel, the readers
    fail at once naming that, and keep version 3; version 5 goes through a new channel."""
    device = "cuda:0" if backend == "cuda" else "cpu"
    weights = WorkerWeights(ServingLock(), lambda: f"rank {rank}", bucket_bytes=BUCKET_BYTES)
    module = make_module(device)
    if rank == 0:
        return _write(weights, module, path, backend, [f"r{i}" for i in range(1, world)])
    out: dict[str, Any] = {}
    layout = weights.layout_for(module, BUCKET_BYTES).to_dict()
    endpoint = weights.init_endpoint(module, strategy, None, layout)
    name = w._read_name(path)
    for version in (1, 2, 3, 4):
        out[f"v{version}"] = w.outcome(
            lambda v=version: weights.ipc_receive(module, name, rank - 1, v, Deadline(w.DEADLINE))
        )
        if out[f"v{version}"]["ok"]:
            endpoint.apply(version)
        out[f"v{version}"]["sum"] = weights_sum(module)
        out[f"v{version}"]["applied"] = endpoint.version
    out["left"] = weights.ipc_reader.name is None  # a failed version leaves the channel
    name = w._read_name(path + ".5")
    out["v5"] = w.outcome(lambda: weights.ipc_receive(module, name, rank - 1, 5, Deadline(w.DEADLINE)))
    endpoint.apply(5)
    out["v5"]["sum"] = weights_sum(module)
    weights.release()
    return out


def _write(weights: WorkerWeights, module: nn.Module, path: str, backend: str, readers: list[str]) -> Any:
    out: dict[str, Any] = {"names": []}
    name = weights.ipc_channel(module, readers, backend, BUCKET_BYTES)
    w._publish_name(path, name)
    send = weights.ipc_send
    for version in (1, 2, 3):
        set_version(module, version)
        assert weights.ipc_channel(module, readers, backend, BUCKET_BYTES) == name  # kept across versions
        out[f"v{version}"] = w.outcome(lambda v=version: send(module, name, v, Deadline(w.DEADLINE)))
    wrong = module[0].weight
    with torch.no_grad():
        module[0].weight = nn.Parameter(torch.zeros(8, 16, device=wrong.device))  # a reshaped parameter
    out["v4"] = w.outcome(lambda: weights.ipc_send(module, name, 4, Deadline(w.DEADLINE)))
    out["closed"] = weights.ipc_writer.name is None
    module[0].weight = wrong
    set_version(module, 5)
    fresh = weights.ipc_channel(module, readers, backend, BUCKET_BYTES)
    out["new_channel"] = fresh != name
    w._publish_name(path + ".5", fresh)
    out["v5"] = w.outcome(lambda: weights.ipc_send(module, fresh, 5, Deadline(w.DEADLINE)))
    weights.release()
    return out
