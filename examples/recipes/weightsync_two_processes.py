"""Recipe: rlfleet-weightsync alone, between two plain torch processes (no Ray).

A trainer process broadcasts its weights over gloo as versioned, bucketed syncs; the rollout
process stages them in a `DoubleBuffer` (it could keep serving the old version meanwhile) and
swaps on commit. Needs only rlfleet-weightsync (`pip install ./packages/weightsync`, README: Install).

    python examples/recipes/weightsync_two_processes.py
"""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    DoubleBuffer,
    Layout,
    checksum,
    init_process_group_bounded,
)

VERSIONS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 16)).to(
        torch.bfloat16
    )


def run(rank: int, address: str, results: dict[str, object]) -> None:
    init_process_group_bounded("gloo", address, rank, 2, join_timeout=60)
    model = make_model()
    layout = Layout.from_state_dict(model.state_dict(), bucket_bytes=1 << 16)  # once per model
    if rank == 0:  # the trainer: change the weights, then publish them as the next version
        sender = BroadcastSender(layout, group=None, src_rank=0, checksums=True)
        for version in range(1, VERSIONS + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * version)
            sender.send(model.state_dict(), version=version, deadline=60.0)
        results["trainer"] = checksum(model.state_dict())
    else:  # the rollout worker: each sync lands in staging, then swaps in at commit
        receiver = BroadcastReceiver(layout, group=None, src_rank=0)
        buffer = DoubleBuffer(model, layout)
        for _ in range(VERSIONS):
            receiver.receive(buffer, deadline=60.0)
        results["rollout"] = checksum(model.state_dict())
        results["version"] = buffer.version


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    address = f"tcp://127.0.0.1:{free_port()}"
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(run, args=(address, results), nprocs=2, join=True)
        same = results["trainer"] == results["rollout"]
        print(f"rollout worker at version {results['version']}; weights identical to the trainer's: {same}")
        return 0 if same and results["version"] == VERSIONS else 1


if __name__ == "__main__":
    raise SystemExit(main())
