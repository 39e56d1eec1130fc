"""The checks `gpu_check.py` runs: process bodies (CUDA IPC sender and reader, NCCL) and offload.

Every body returns a JSON-safe dict; `gpu_check.py` turns them into claims. torch and
rlfleet.weightsync are imported inside the functions (spawned children import this module).
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Mapping
from typing import Any

from _state import Spec, build_state


def _spec(cfg: Mapping[str, Any]) -> Spec:
    return [(n, tuple(s), d) for n, s, d in cfg["spec"]]


def _seed(version: int) -> int:
    """The sender alternates two prebuilt states: version v carries seed 1 + v % 2."""
    return 1 + version % 2


def mismatched(live: Mapping[str, Any], spec: Spec, version: int, device: str) -> list[str]:
    """Names whose bytes differ from what the sender sent as `version` (first five)."""
    import torch

    expected = build_state(spec, seed=_seed(version), device=device)
    bad = [
        name
        for name, want in expected.items()
        if not torch.equal(want.reshape(-1).view(torch.uint8), live[name].reshape(-1).view(torch.uint8))
    ]
    return bad[:5]


class FailAt:
    """A consumer that fails at bucket `bucket`. On a GPU it first queues a copy of that slot on
    a side stream behind a GPU spin: the receiver must wait for it before releasing the slot."""

    def __init__(self, inner: Any, bucket: int) -> None:
        self.inner = inner
        self.bucket = bucket
        self.copy: Any = None

    @property
    def layout(self) -> Any:
        return self.inner.layout

    @property
    def version(self) -> int:
        return int(self.inner.version)

    def begin(self, version: int) -> None:
        self.inner.begin(version)

    def consume(self, index: int, data: Any) -> None:
        import torch

        if index != self.bucket:
            self.inner.consume(index, data)
            return
        if data.is_cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                torch.cuda._sleep(1_000_000_000)  # about half a second of spin, then the read
                self.copy = data.clone()
        raise RuntimeError(f"injected consumer failure at bucket {index}")

    def commit(self, version: int) -> None:
        self.inner.commit(version)

    def abort(self, error: BaseException) -> None:
        self.inner.abort(error)


def _wait_for_file(path: str, seconds: float = 120.0) -> str:
    end = time.monotonic() + seconds
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"the sender never published its channel name at {path}")
        time.sleep(0.01)
    with open(path) as fh:
        return fh.read()


def _publish_name(path: str, name: str) -> None:
    """Write a channel's name where the other processes wait for it (atomically)."""
    with open(path + ".tmp", "w") as fh:
        fh.write(name)
    os.replace(path + ".tmp", path)


def _timed_send(sender: Any, state: Any, version: int, deadline: float) -> float:
    start = time.perf_counter()
    sender.send(state, version, deadline)
    return time.perf_counter() - start


def ipc_sender(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Versions 1..R+1 (reader: "None" in place), R+2 (reader: DoubleBuffer), R+3 (the reader's
    consumer fails: aborted), R+4..2R+4 (DoubleBuffer). Seconds per version, by phase."""
    import torch

    from rlfleet.weightsync import CudaIpcSender, Layout, SyncAbortedError

    device, reps, deadline = cfg["device"], cfg["reps"], cfg["deadline"]
    if device == "cuda":
        torch.cuda.set_device(0)
    states = {seed: build_state(_spec(cfg), seed=seed, device=device) for seed in (1, 2)}
    layout = Layout.from_state_dict(states[1], cfg["bucket_bytes"])

    def send(version: int) -> float:
        return _timed_send(sender, states[_seed(version)], version, deadline)

    with CudaIpcSender(layout, 1, backend=cfg["backend"]) as sender:
        _publish_name(cfg["path"], sender.name)
        in_place = [send(v) for v in range(1, reps + 2)]
        send(reps + 2)
        try:
            send(reps + 3)
            aborted = "no error"
        except SyncAbortedError as exc:
            aborted = type(exc).__name__
        double = [send(v) for v in range(reps + 4, 2 * reps + 5)]
    return {
        "in_place": in_place[1:],  # the first version pays first-touch costs
        "double": double,
        "aborted": aborted,
        "tensor_bytes": layout.total_bytes,
    }


def ipc_reader(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The other side of `ipc_sender`; checks bytes after each phase against a fresh copy."""
    import torch

    from rlfleet.weightsync import CudaIpcReceiver, DirectBuffer, DoubleBuffer, Layout, SyncAbortedError

    device, reps, deadline = cfg["device"], cfg["reps"], cfg["deadline"]
    if device == "cuda":
        torch.cuda.set_device(0)
    spec = _spec(cfg)
    name = _wait_for_file(cfg["path"])
    live = build_state(spec, fill=False, device=device)
    layout = Layout.from_state_dict(live, cfg["bucket_bytes"])
    out: dict[str, Any] = {}
    with CudaIpcReceiver.attach(name, 0) as receiver:
        in_place = DirectBuffer(live, layout, max_staging_bytes=0)  # "None" in place: no staging copy
        for _ in range(reps + 1):
            receiver.receive(in_place, deadline)
        double = DoubleBuffer(build_state(spec, fill=False, device=device), layout)
        receiver.receive(double, deadline)
        failing = FailAt(double, bucket=min(1, len(layout.buckets) - 1))
        try:
            receiver.receive(failing, deadline)
            out["abort_error"] = "no error"
        except SyncAbortedError as exc:
            out["abort_error"] = type(exc).__name__
        out["abort_version"] = double.version
        out["abort_mismatched"] = mismatched(double.live, spec, reps + 2, device)
        for _ in range(reps + 1):
            receiver.receive(double, deadline)
    out["in_place_version"] = in_place.version
    out["in_place_mismatched"] = mismatched(live, spec, reps + 1, device)
    out["double_version"] = double.version
    out["double_mismatched"] = mismatched(double.live, spec, 2 * reps + 4, device)
    out["settled"] = _settled(failing, layout, spec, reps + 3, device)
    return out


def _settled(failing: FailAt, layout: Any, spec: Spec, version: int, device: str) -> bool | None:
    """Whether the side-stream read the failing consumer queued saw the failed version's bytes."""
    import torch

    from rlfleet.weightsync import bucket_views, pack_bucket

    if failing.copy is None:
        return None  # host slots: nothing was queued
    torch.cuda.synchronize()
    k = failing.bucket
    packed = pack_bucket(
        layout,
        k,
        build_state(spec, seed=_seed(version), device=device),
        torch.zeros(layout.buckets[k].nbytes, dtype=torch.uint8, device=device),
    )
    got, want = bucket_views(layout, k, failing.copy), bucket_views(layout, k, packed)
    return all(
        torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)) for n in want
    )


def nccl_child(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """A one-rank NcclWire through the real CuPy API: the protocol's bucket loop, a rebuild on the
    same store and name, and an init bounded by its deadline while rank 1 never initializes."""
    import torch

    from rlfleet.weightsync import Layout, NcclSender, NcclWire, bucket_segments

    torch.cuda.set_device(0)
    store = torch.distributed.HashStore()
    state = build_state(_spec(cfg), seed=1, device="cuda")
    before = {name: tensor.clone() for name, tensor in state.items()}
    layout = Layout.from_state_dict(state, cfg["bucket_bytes"])
    out: dict[str, Any] = {"gbps": {}, "loops": []}
    for attempt, direct_min in enumerate((4 << 20, 1 << 62)):  # large tensors in place; all packed
        wire = NcclWire.create(store, 0, 1, deadline=60.0)  # the second is a rebuild, same name
        try:
            sender = NcclSender(layout, wire, checksums=attempt == 0, direct_min=direct_min)
            stats = sender.send(state, 0, cfg["deadline"])
            times = []
            for version in range(1, cfg["reps"] + 1):
                torch.cuda.synchronize()
                times.append(_timed_send(sender, state, version, cfg["deadline"]))
            torch.cuda.synchronize()
            segments = (bucket_segments(layout, k, direct_min) for k in range(len(layout.buckets)))
            out["loops"].append(stats.wire_bytes == sum(s.nbytes for b in segments for s in b))
            out["gbps"]["in place" if attempt == 0 else "packed"] = (
                layout.total_bytes / statistics.median(times) / 1e9
            )
        finally:
            wire.close()
    out["untouched"] = all(torch.equal(before[n], state[n]) for n in before)
    out["bounded"] = _bounded_init(store)
    return out


def _bounded_init(store: Any) -> dict[str, Any]:
    """Rank 1 joins group "bounded" but never calls ncclCommInitRank: rank 0's init must end at
    its deadline naming rank 1 (the init thread it leaves behind dies with this process)."""
    from rlfleet.weightsync import NcclWire, RendezvousTimeoutError, join_generation
    from rlfleet.weightsync.cuda._nccl_init import group_prefix

    def rank1() -> None:
        join_generation(store, group_prefix("bounded"), 1, range(2), 30.0, "gpu_check", lead=0)

    threading.Thread(target=rank1, daemon=True).start()
    start = time.monotonic()
    try:
        NcclWire.create(store, 0, 2, deadline=10.0, name="bounded")
    except RendezvousTimeoutError as exc:
        missing = list(exc.missing_ranks)
        return {"missing": missing, "seconds": time.monotonic() - start, "message": str(exc)[:300]}
    return {"missing": None, "seconds": time.monotonic() - start, "message": "the init returned"}


def offload_check(device: str, width: int, layers: int) -> dict[str, Any]:
    """Offload a trained module and its Adam state, then reload: bit-exact, memory freed.

    On a GPU one parameter is rewritten on a side stream (behind a GPU spin) just before the
    offload: the offload must wait for every stream, so that write is what comes back.
    """
    import torch

    from rlfleet.weightsync import offload_module, offload_optimizer, reload_module, reload_optimizer

    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    model = model.to(device=device, dtype=dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, width, device=device, dtype=dtype)).float().pow(2).mean().backward()
    optimizer.step()
    tensors = _offloaded_tensors(model, optimizer)
    expected = {name: tensor.detach().cpu().clone() for name, tensor in tensors.items()}
    first = next(iter(model.parameters()))
    if device == "cuda":
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1_000_000_000)
            first.data.fill_(0.5)
        expected["param.0"].fill_(0.5)
        allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    moved = offload_module(model).nbytes
    moved += offload_optimizer(optimizer, empty_cache=device == "cuda").nbytes
    out: dict[str, Any] = {
        "moved": moved,
        "emptied": all(t.untyped_storage().nbytes() == 0 for t in tensors.values()),
    }
    if device == "cuda":
        out["allocated_drop"] = allocated - torch.cuda.memory_allocated()
        out["reserved_drop"] = reserved - torch.cuda.memory_reserved()
    reload_module(model)
    reload_optimizer(optimizer)
    back = _offloaded_tensors(model, optimizer)
    out["mismatched"] = [
        name
        for name, want in expected.items()
        if not torch.equal(
            want.reshape(-1).view(torch.uint8), back[name].detach().cpu().reshape(-1).view(torch.uint8)
        )
    ][:5]
    return out


def _offloaded_tensors(model: Any, optimizer: Any) -> dict[str, Any]:
    """Parameters, gradients and optimizer state by a stable name (param.i, grad.i, state.i.key)."""
    out: dict[str, Any] = {}
    for i, param in enumerate(model.parameters()):
        out[f"param.{i}"] = param
        if param.grad is not None:
            out[f"grad.{i}"] = param.grad
        for key, value in optimizer.state[param].items():
            if hasattr(value, "untyped_storage"):
                out[f"state.{i}.{key}"] = value
    return out
