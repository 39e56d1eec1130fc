"""Process bodies for the rollout-engine refit test: two trainers (BasePolicy) and three engine
ranks that are not policies at all: they speak only weightsync (MemberGroup + BroadcastReceiver).

Engines ``engine_gpu_counts=[1, 2]``, ``engine_gpu_offsets=[2, 0]``: engine 0 is engine rank 2,
engine 1 spans engine ranks 0 and 1. World: trainers 0, 1, then engine ranks 0..2 (5 ranks).
The trainers keep fp32 weights and the engines serve bf16 (``wire_dtype="bfloat16"``): each
version travels cast once by the sending trainer.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import torch
import torch.multiprocessing as mp
from refit_procs import collect, report
from testkit import free_port, outcome

from rlfleet.policygroup import BasePolicy, PolicyConfig, RolloutEngines, WeightBufferConfig
from rlfleet.weightsync import BroadcastReceiver, DirectBuffer, Layout, MemberGroup, checksum, connect_store

TRAINERS = 2
COUNTS, OFFSETS = [1, 2], [2, 0]
WORLD = TRAINERS + sum(COUNTS)
BUCKET = 4096
DEADLINE_S = 60.0
ENGINES = [(0, 0), (1, 0), (1, 1)]  # (engine, GPU rank within it), one process each
DYING = (1, 1)  # leaves after version 2


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 6))


def version_state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + version)
    return {k: torch.randn(v.shape, generator=g) for k, v in build_model().state_dict().items()}


def served(version: int) -> str:
    """The checksum of `version` as the engines serve it (bf16)."""
    return checksum({k: v.to(torch.bfloat16) for k, v in version_state(version).items()})


class Trainer(BasePolicy):
    def build_model(self) -> torch.nn.Module:
        return build_model()


def trainer(index: int, port: int) -> dict[str, Any]:
    buffer = WeightBufferConfig(bucket_bytes=BUCKET, wire_dtype="bfloat16")
    config = PolicyConfig(group_timeout_s=60.0, weight_buffer=buffer)
    policy = Trainer(config, role="train", index=index, device="cpu")
    policy.init_collective("127.0.0.1", port, WORLD, train_world_size=TRAINERS)
    policy.connect_sglang_rollout_engines(engine_gpu_counts=COUNTS, engine_gpu_offsets=OFFSETS)
    out: dict[str, Any] = {}
    for version in (1, 2):
        policy.load_state_dict(version_state(version))
        out[f"v{version}"] = outcome(lambda: policy.refit_rollout_engines(refit_timeout_s=DEADLINE_S))
        # the same topology again: nothing is rebuilt (the engines do not rejoin)
        policy.connect_sglang_rollout_engines(engine_gpu_counts=COUNTS, engine_gpu_offsets=OFFSETS)
    out["state_before_loss"] = json.loads(json.dumps(policy._refit_transport_state("rollout_engines")))
    policy.load_state_dict(version_state(3))
    out["v3"] = outcome(lambda: policy.refit_rollout_engines(refit_timeout_s=DEADLINE_S))
    out["version_after_loss"] = policy.get_weight_version()
    out["state"] = json.loads(json.dumps(policy._refit_transport_state("rollout_engines")))
    out["v4"] = outcome(lambda: policy.refit_rollout_engines(refit_timeout_s=DEADLINE_S))
    # the lost engine is back (a new process): the same topology is connected anew
    policy.connect_sglang_rollout_engines(engine_gpu_counts=COUNTS, engine_gpu_offsets=OFFSETS)
    out["v3_again"] = outcome(lambda: policy.refit_rollout_engines(version=3, refit_timeout_s=DEADLINE_S))
    out["state_recovered"] = json.loads(json.dumps(policy._refit_transport_state("rollout_engines")))
    return out


def _join(store: Any, rank: int, model: torch.nn.Module) -> tuple[BroadcastReceiver, DirectBuffer]:
    """Join the refit group (its name and ranks follow from the topology) and get a receiver."""
    topology = RolloutEngines.describe(TRAINERS, COUNTS, OFFSETS)
    group = MemberGroup.create(store, topology.prefix, rank, topology.size, DEADLINE_S)
    layout = Layout.from_state_dict(model.state_dict(), BUCKET)
    return BroadcastReceiver(layout, group, 0), DirectBuffer(model, layout)


def engine(engine_index: int, local_rank: int, port: int, recovered: bool = False) -> dict[str, Any]:
    """A rollout engine rank that knows only weightsync and the topology's naming rule."""
    rank = RolloutEngines.describe(TRAINERS, COUNTS, OFFSETS).member_rank(engine_index, local_rank)
    store = connect_store("127.0.0.1", port, rank, WORLD, DEADLINE_S)
    model = build_model().to(torch.bfloat16)
    out: dict[str, Any] = {"member_rank": rank}
    if recovered:  # joins the rebuilt refit group only
        receiver, buffer = _join(store, rank, model)
        out["v3_again"] = receiver.receive(buffer, DEADLINE_S).version
        out["exact"] = checksum(model.state_dict()) == served(3)
        return out
    MemberGroup.create(store, "collective", rank, WORLD, DEADLINE_S)  # the init_collective world
    receiver, buffer = _join(store, rank, model)
    for version in (1, 2):
        stats = receiver.receive(buffer, DEADLINE_S)
        out[f"v{version}"] = {
            "version": stats.version,
            "exact": checksum(model.state_dict()) == served(version),
        }
    if (engine_index, local_rank) == DYING:
        return out  # the process exits now: the next refit loses a peer
    before = checksum(model.state_dict())
    out["v3"] = outcome(lambda: receiver.receive(buffer, DEADLINE_S).version)
    out["kept_v2"] = checksum(model.state_dict()) == before and buffer.version == 2
    del receiver, buffer  # leave the broken group: its sockets close, which its peers wait for
    gc.collect()  # a failed receive's traceback may hold the old group in a reference cycle
    receiver, buffer = _join(store, rank, model)  # the trainers connect again
    out["v3_again"] = receiver.receive(buffer, DEADLINE_S).version
    out["exact"] = checksum(model.state_dict()) == served(3)
    return out


def worker(kind: str, ident: tuple[int, int], port: int, queue: Any) -> None:
    torch.set_num_threads(1)
    if kind == "trainer":
        report(queue, (kind, ident), lambda: trainer(ident[0], port))
    report(queue, (kind, ident), lambda: engine(ident[0], ident[1], port, recovered=kind == "recovered"))


def run(timeout: float = 240.0) -> dict[tuple[str, tuple[int, int]], dict[str, Any]]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    jobs = [("trainer", (i, 0)) for i in range(TRAINERS)] + [("engine", e) for e in ENGINES]
    procs = [ctx.Process(target=worker, args=(k, i, port, queue), daemon=True) for k, i in jobs]

    def replace_the_lost_engine(key: Any) -> None:
        if key == ("engine", DYING):  # it is gone: start its replacement
            procs.append(ctx.Process(target=worker, args=("recovered", DYING, port, queue), daemon=True))
            procs[-1].start()

    return collect(procs, queue, len(jobs) + 1, timeout, replace_the_lost_engine)
