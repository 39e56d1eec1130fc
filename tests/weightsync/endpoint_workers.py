"""Process bodies for the endpoint tests over a real wire (spawned: they live in a module).

One gloo world of six processes under `weightsync_dist_workers.run_ranks`: process 0 broadcasts
versions of a small module's state; the others receive through one endpoint each (1 "None",
2 "Double", 3 "Shared" writing its node buffer, 4 and 5 "Sharded" sharing each version), and
process 1 also reads process 3's node buffer zero-copy through a second "Shared" endpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    Layout,
    SharedBuffer,
    checksum,
    create_endpoint,
    live_tensors,
)

DEADLINE = 60.0
NAME_BYTES = 128
STRATEGY = {1: "None", 2: "Double", 3: "Shared", 4: "Sharded", 5: "Sharded"}


def make_module(version: int = 0) -> torch.nn.Module:
    """A small module with parameters of two dtypes and a buffer; its values depend on `version`."""
    torch.manual_seed(500 + version)
    module = torch.nn.Sequential(torch.nn.Linear(8, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))
    module[2].to(torch.bfloat16)
    module.register_buffer("steps", torch.tensor([version, 2 * version], dtype=torch.int64))
    return module


def state(version: int) -> dict[str, torch.Tensor]:
    return make_module(version).state_dict()


def layout() -> Layout:
    return Layout.from_state_dict(state(0), 1024)


def _name_round(name: str | None, src: int) -> str:
    """Broadcast a node buffer's name from `src` (fixed-size bytes, no pickle)."""
    raw = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    if name is not None:
        data = name.encode()
        raw[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(raw, src)
    return bytes(raw.tolist()).rstrip(b"\0").decode()


def _report(module: torch.nn.Module, endpoint: Any) -> dict[str, Any]:
    return {
        "version": endpoint.version,
        "staged": endpoint.staged_version,
        "checksum": checksum(module.state_dict()),
    }


def scenario_endpoints(rank: int, world: int, port: int) -> dict[str, Any]:
    w.init(rank, world, port)
    sharded_group = dist.new_group([4, 5])  # a collective of the whole world
    lay = layout()
    writer = SharedBuffer(lay, 2, timeout_s=DEADLINE) if rank == 3 else None
    node_buffer = _name_round(writer.name if writer is not None else None, 3)
    out: dict[str, Any] = {"rounds": []}
    if rank == 0:
        sender = BroadcastSender(lay, None, 0)
        for version in (1, 2, 2):  # the last one a retry that every receiver already holds
            sender.send(state(version), version, DEADLINE)
            dist.barrier()
        dist.barrier()
        return out
    module = make_module(0)
    endpoint = create_endpoint(
        STRATEGY[rank],
        module,
        lay,
        node_buffer=node_buffer if rank == 3 else None,
        node_writer=writer,
        shard=(rank - 4, 2) if rank >= 4 else None,
    )
    reader_module = make_module(0) if rank == 1 else None
    reader = None
    if reader_module is not None:
        reader = create_endpoint("Shared", reader_module, lay, node_buffer=node_buffer)
    receiver = BroadcastReceiver(lay, None, 0)
    for version in (1, 2, 2):
        endpoint.receive(receiver, version, DEADLINE)
        received = _report(module, endpoint)
        endpoint.apply(version, DEADLINE, group=sharded_group)
        round_ = {"received": received, "applied": _report(module, endpoint)}
        if reader is not None and reader_module is not None:
            reader.stage_from_node(node_buffer, version, DEADLINE)
            reader.apply(version, DEADLINE)
            round_["reader"] = _report(reader_module, reader)
            start, end = reader.data_range()  # type: ignore[attr-defined]
            round_["zero_copy"] = all(
                start <= t.data_ptr() < end for t in live_tensors(reader_module).values()
            )
        out["rounds"].append(round_)
        dist.barrier()
    for e in (endpoint, reader):
        if e is not None:
            e.release()
    out["after_release"] = checksum(module.state_dict())
    if writer is not None:
        out["private"] = all(t.untyped_storage().resizable() for t in live_tensors(module).values())
    dist.barrier()  # every reader left before the writer unlinks its segment
    if writer is not None:
        writer.close()
    return out


#: (version the sender announces, version every endpoint asks for) per round: two rounds where
#: the sender announces v9, one asked while no endpoint holds the asked version and one while
#: every endpoint already holds it (the retry path that drops the bytes).
ANNOUNCED = ((1, 1), (9, 5), (6, 6), (9, 6), (7, 7))


def scenario_announced_version(rank: int, world: int, port: int) -> dict[str, Any]:
    """The sender announces another version than the endpoints ask for: nothing may land."""
    w.init(rank, world, port)
    sharded_group = dist.new_group([4, 5])
    lay = layout()
    writer = SharedBuffer(lay, 2, timeout_s=DEADLINE) if rank == 3 else None
    node_buffer = _name_round(writer.name if writer is not None else None, 3)
    out: dict[str, Any] = {"rounds": []}
    if rank == 0:
        sender = BroadcastSender(lay, None, 0)
        for announced, _ in ANNOUNCED:
            out["rounds"].append(w.outcome(lambda v=announced: sender.send(state(v), v, DEADLINE).version))
            dist.barrier()
        dist.barrier()
        return out
    module = make_module(0)
    endpoint = create_endpoint(
        STRATEGY[rank],
        module,
        lay,
        node_buffer=node_buffer if rank == 3 else None,
        node_writer=writer,
        shard=(rank - 4, 2) if rank >= 4 else None,
    )
    receiver = BroadcastReceiver(lay, None, 0)
    for _, asked in ANNOUNCED:
        got = w.outcome(lambda v=asked: endpoint.receive(receiver, v, DEADLINE))
        got["received"] = _report(module, endpoint)
        if writer is not None:
            got["node_buffer"] = writer.latest_version()
        if got["ok"]:
            endpoint.apply(asked, DEADLINE, group=sharded_group)
        elif rank >= 4:  # the Sharded pair applies together or not at all
            endpoint.apply(None, DEADLINE, group=sharded_group)
        got["applied"] = _report(module, endpoint)
        out["rounds"].append(got)
        dist.barrier()
    endpoint.release()
    dist.barrier()
    if writer is not None:
        writer.close()
    return out
