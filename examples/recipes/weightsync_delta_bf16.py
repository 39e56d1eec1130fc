"""Recipe: an fp32 trainer syncing a bf16 engine with deltas (rlfleet-weightsync alone, no Ray).

The trainer keeps fp32 master weights and steps AdamW at lr 1e-6; the rollout process serves
bf16. The layout carries bf16 (`wire_dtype`: the trainer casts while packing, half the bytes),
and ``delta="auto"`` sends each version as the bf16 words that changed since the version the
receiver committed: most do not (a step of 1e-6 is far below one bf16 step), so a sync moves a
few percent of the bytes. The receiver rebuilds each bucket in its standby copy from its own
base, checks it against the sender's digest, and only then commits (two-phase, as every sync).

    python examples/recipes/weightsync_delta_bf16.py
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

VERSIONS = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 512))


def run(rank: int, address: str, results: dict[str, object]) -> None:
    init_process_group_bounded("gloo", address, rank, 2, join_timeout=60)
    model = make_model()  # fp32 on both sides at first
    if rank == 0:  # the trainer: fp32 weights, bf16 on the wire, deltas
        layout = Layout.from_state_dict(model.state_dict(), bucket_bytes=1 << 20, wire_dtype=torch.bfloat16)
        sender = BroadcastSender(layout, group=None, src_rank=0, delta="auto")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
        for version in range(1, VERSIONS + 1):
            model(torch.randn(8, 512)).square().mean().backward()
            opt.step()
            stats = sender.send(model.state_dict(), version=version, deadline=60.0)
            kind = "full" if stats.base is None else f"delta against {stats.base}"
            print(
                f"version {version}: {kind}, {stats.wire_bytes:,} of {stats.full_bytes:,} bytes", flush=True
            )
        results["trainer"] = checksum({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    else:  # the rollout worker: serves bf16, rebuilds each delta on its own base
        engine = model.to(torch.bfloat16)
        layout = Layout.from_state_dict(engine.state_dict(), bucket_bytes=1 << 20)  # = the trainer's digest
        receiver = BroadcastReceiver(layout, group=None, src_rank=0)
        buffer = DoubleBuffer(engine, layout)
        for _ in range(VERSIONS):
            receiver.receive(buffer, deadline=60.0)
        results["rollout"] = checksum(engine.state_dict())
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
        print(
            f"rollout worker at version {results['version']}; bf16 weights identical to the trainer's: {same}"
        )
        return 0 if same and results["version"] == VERSIONS else 1


if __name__ == "__main__":
    raise SystemExit(main())
