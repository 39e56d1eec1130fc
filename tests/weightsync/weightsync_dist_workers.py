"""Process bodies for the multi-process gloo tests (spawned, so they live in an importable module)."""

from __future__ import annotations

import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from testkit import free_port, outcome  # outcome: the scenarios here and their users (w.outcome)

from rlfleet.weightsync import Layout, RecordingConsumer, checksum

BUCKET = 64 * 1024
DIRECT_MIN = 16 * 1024


# -- models ------------------------------------------------------------------------------------
def make_state(version: int, small: int = 120) -> dict[str, torch.Tensor]:
    """Mixed dtypes, an oversized tensor, large direct tensors and many small ones."""
    g = torch.Generator().manual_seed(1000 + version)
    sd: dict[str, torch.Tensor] = {}
    sd["embed.weight"] = torch.randn(300, 128, generator=g).to(torch.bfloat16)  # 75 KiB > bucket
    sd["big.fp32"] = torch.randn(40, 128, generator=g)  # 20 KiB: direct, shares a bucket
    sd["step"] = torch.tensor([version], dtype=torch.int64)
    sd["mask"] = torch.rand(33, 7, generator=g) > 0.5
    sd["f8"] = torch.randn(17, 9, generator=g).to(torch.float8_e4m3fn)
    sd["ids"] = torch.randint(-(2**40), 2**40, (123,), generator=g, dtype=torch.int64)
    sd["empty"] = torch.zeros(0, 4)
    sd["scalar"] = torch.tensor(3.5 + version)
    for i in range(small):
        n = 1 + (i * 37) % 800  # four 64 KiB buckets with densely packed small tensors
        sd[f"layers.{i}.w"] = torch.randn(n, generator=g).to(torch.bfloat16 if i % 3 else torch.float32)
    # a non-contiguous source on the sender side (a transposed view)
    sd["transposed"] = torch.randn(96, 64, generator=g).t()
    return sd


def layout_of(sd: Mapping[str, torch.Tensor], bucket: int = BUCKET) -> Layout:
    return Layout.from_state_dict(sd, bucket)


class FlakyMapping(Mapping[str, torch.Tensor]):
    """A state dict whose `name`, from its `after`-th access on, kills the process ("kill"),
    stalls for `seconds` ("sleep": a producer slower than the sync's deadline) or fails ("raise");
    any other action reads normally."""

    def __init__(
        self, base: Mapping[str, torch.Tensor], name: str, after: int, action: str, seconds: float = 0.0
    ) -> None:
        self.base, self.name, self.after, self.action, self.seconds = base, name, after, action, seconds
        self.count = 0

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == self.name:
            self.count += 1
            if self.count > self.after:
                if self.action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.action == "sleep":
                    time.sleep(self.seconds)
                if self.action == "raise":
                    raise RuntimeError(f"injected failure producing {key!r}")
        return self.base[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


# -- harness -----------------------------------------------------------------------------------
_STORE_PORT: Any = None  # shared cell: the port rank 0's store actually bound (see `init`)


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world: int,
    port: int,
    queue: Any,
    args: tuple[Any, ...],
    cell: Any = None,
) -> None:
    global _STORE_PORT
    _STORE_PORT = cell
    torch.set_num_threads(1)
    try:
        result = fn(rank, world, port, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:
        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    # Leave at once: a half-built store or group (the point of some tests) can stall a normal exit.
    queue.close()
    queue.join_thread()
    os._exit(0)


class FreshPort:
    """Placeholder in `run_ranks` args: replaced by a free port on every attempt."""


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout: float = 90.0, expect_dead: tuple[int, ...] = ()
) -> dict[int, Any]:
    """Run `fn(rank, world, port, *args)` in `world` spawned processes; results by rank.

    A port picked free can be taken by another process before our rank binds it (the machine
    runs other suites too): such a run is retried with fresh ports, up to three times.
    """
    for attempt in range(3):
        try:
            return _run_once(fn, world, args, timeout, expect_dead)
        except _PortTaken:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


class _PortTaken(AssertionError):
    pass


def _run_once(
    fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout: float, expect_dead: tuple[int, ...]
) -> dict[int, Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    args = tuple(free_port() if isinstance(a, FreshPort) else a for a in args)
    cell = ctx.Value("i", 0)
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, queue, args, cell), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    end = time.monotonic() + timeout
    expected = world - len(expect_dead)
    failed: str | None = None
    try:
        while len(results) < expected and time.monotonic() < end:
            try:
                rank, status, value = queue.get(timeout=0.5)
            except Exception:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
                continue
            if status != "ok":
                failed = f"rank {rank} failed:\n{value}"
                break
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=0.1 if failed else max(0.1, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    if failed is not None:
        if "EADDRINUSE" in failed or "address already in use" in failed.lower():
            raise _PortTaken(failed)
        raise AssertionError(failed)
    missing = [r for r in range(world) if r not in results and r not in expect_dead]
    if missing:
        raise AssertionError(f"ranks {missing} returned nothing within {timeout}s")
    return results


def init(rank: int, world: int, port: int, timeout: float = 30.0) -> None:
    """The default gloo group. Under `run_ranks`, rank 0's store binds a port of its own choosing
    and the others learn it through a shared cell: no window in which a suite running beside
    this one could take (or join) the port."""
    from datetime import timedelta

    cell = _STORE_PORT
    if cell is None:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout),
        )
        return
    wait = timedelta(seconds=60)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=wait, wait_for_workers=False)
        cell.value = store.port
    else:
        end = time.monotonic() + 60
        while cell.value == 0:
            if time.monotonic() > end:
                raise TimeoutError("rank 0 never published its store port")
            time.sleep(0.005)
        store = dist.TCPStore("127.0.0.1", cell.value, world, is_master=False, timeout=wait)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )


# -- scenarios ---------------------------------------------------------------------------------
DEADLINE = 30.0


def scenario_protocol(rank: int, world: int, port: int) -> dict[str, Any]:
    """Sender rank 0; rank 1 lands buckets in its consumer's storage, the others use buffers."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender, adopt, flat_block

    init(rank, world, port)
    base = make_state(0)
    layout = layout_of(base)
    steps: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, direct_min=DIRECT_MIN)

        def send(sd: Mapping[str, torch.Tensor], version: int) -> Any:
            return outcome(lambda: sender.send(sd, version, DEADLINE).wire_bytes)

        steps["v1"] = send(make_state(1), 1)
        sender.checksums = True
        steps["v2"] = send(make_state(2), 2)
        steps["stale"] = send(make_state(2), 2)
        steps["layout"] = send(make_state(3), 3)
        steps["consumer"] = send(make_state(3), 3)
        steps["midway"] = send(FlakyMapping(make_state(3), "layers.100.w", 1, "raise"), 3)
        missing = dict(make_state(3))
        del missing["layers.50.w"]
        steps["upfront"] = send(missing, 3)
        steps["v3"] = send(make_state(3), 3)
        adopted = make_state(4)
        adopt(adopted, layout)  # every bucket is now a slice of one block: sent without packing
        steps["adopted_in_block"] = flat_block(layout, adopted) is not None
        steps["adopted"] = send(adopted, 4)
        steps["broken"] = sender.broken
        return steps
    receiver = BroadcastReceiver(layout, None, 0)
    consumer = RecordingConsumer(layout, base, bucket_targets=rank == 1, tensor_targets=rank == 2)

    def recv(c: RecordingConsumer) -> dict[str, Any]:
        result = outcome(lambda: receiver.receive(c, DEADLINE).version)
        result["applied"] = consumer.version
        result["checksum"] = checksum(consumer.weights)
        return result

    steps["v1"] = recv(consumer)
    steps["v2"] = recv(consumer)
    steps["stale"] = recv(consumer)
    if rank == 2:
        other = dict(base)
        other["layers.7.w"] = torch.zeros(3, 3)
        steps["layout"] = recv(RecordingConsumer(layout_of(other), other))
    else:
        steps["layout"] = recv(consumer)
    if rank == 2:
        consumer.fail_on = 1
    steps["consumer"] = recv(consumer)
    consumer.fail_on = None
    steps["midway"] = recv(consumer)
    steps["upfront"] = recv(consumer)
    steps["v3"] = recv(consumer)
    steps["adopted"] = recv(consumer)
    steps["aborts"] = len(consumer.aborts)
    steps["landed"] = len(consumer.landed)
    steps["broken"] = receiver.broken
    return steps


def scenario_kill(rank: int, world: int, port: int) -> dict[str, Any]:
    """The sender SIGKILLs itself while packing version 2; receivers must fail within the deadline."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender

    init(rank, world, port, timeout=15.0)
    base = make_state(0)
    layout = layout_of(base)
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, direct_min=DIRECT_MIN)
        sender.send(make_state(1), 1, DEADLINE)
        sender.send(FlakyMapping(make_state(2), "layers.90.w", 1, "kill"), 2, DEADLINE)
        return {"unreachable": True}
    receiver = BroadcastReceiver(layout, None, 0)
    consumer = RecordingConsumer(layout, base, bucket_targets=rank == 1)
    receiver.receive(consumer, DEADLINE)
    start = time.monotonic()
    result = outcome(lambda: receiver.receive(consumer, 20.0))
    result["seconds"] = time.monotonic() - start
    result["applied"] = consumer.version
    result["checksum"] = checksum(consumer.weights)
    result["aborts"] = len(consumer.aborts)
    result["again"] = outcome(lambda: receiver.receive(consumer, 1.0))
    return result


def scenario_rendezvous(rank: int, world: int, port: int, port2: int, port3: int) -> dict[str, Any]:
    """Bounded group creation: a rank that never joins is named, within the deadline."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender
    from rlfleet.weightsync.dist._rendezvous import init_process_group_bounded, new_group_bounded

    out: dict[str, Any] = {}
    url = "tcp://127.0.0.1:{}"
    # Everyone joins first (processes start at different times), so the bounded attempts below
    # time out only for the rank that is deliberately absent.
    init_process_group_bounded("gloo", url.format(port3), rank, world, join_timeout=60.0, timeout=30.0)
    dist.barrier()
    if rank != 2:  # rank 2 never joins this attempt
        out["no_rank2"] = outcome(
            lambda: init_process_group_bounded("gloo", url.format(port), rank, world, join_timeout=2.0)
        )
    dist.barrier()
    if rank != 0:  # rank 0 (the store host) never joins this one
        out["no_rank0"] = outcome(
            lambda: init_process_group_bounded("gloo", url.format(port2), rank, world, join_timeout=2.0)
        )
    dist.barrier()
    if rank != 2:
        out["group_no_rank2"] = outcome(lambda: new_group_bounded([0, 1], join_timeout=2.0))
    # all three call it now; the group of ranks 1 and 2 carries a sync from global rank 1
    dist.barrier()
    group = new_group_bounded([1, 2], join_timeout=30.0)
    base = make_state(0)
    layout = layout_of(base)
    if rank == 1:
        BroadcastSender(layout, group, 1, direct_min=DIRECT_MIN).send(make_state(5), 5, DEADLINE)
    elif rank == 2:
        consumer = RecordingConsumer(layout, base)
        BroadcastReceiver(layout, group, 1).receive(consumer, DEADLINE)
        out["subgroup_checksum"] = checksum(consumer.weights)
    # rank 0 hosts the store the other two still use to build their group: nobody leaves first
    dist.barrier()
    return out


def scenario_sharded(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 0 broadcasts; ranks 1.. each keep 1/N and all-gather the whole model."""
    from rlfleet.weightsync import BroadcastReceiver, BroadcastSender, ShardedBuffer, pack_bucket

    init(rank, world, port)
    members = list(range(1, world))
    group = dist.new_group(members)
    base = make_state(0)
    layout = layout_of(base, bucket=8 * 1024)
    out: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, checksums=True, direct_min=DIRECT_MIN)
        for version in (1, 2):
            sender.send(make_state(version), version, DEADLINE)
        return out
    buffer = ShardedBuffer(layout, rank - 1, len(members))
    receiver = BroadcastReceiver(layout, None, 0)
    out["owned"] = list(buffer.owned)
    out["shard_bytes"] = buffer.shard_bytes
    for version in (1, 2):
        receiver.receive(buffer, DEADLINE)
        views = buffer.gather(group, DEADLINE)
        out[f"v{version}"] = checksum(views)
        out[f"v{version}_names"] = list(views) == list(layout.names)
    # member 2 moves on alone (a local sync of version 9): a gather must refuse mixed versions
    if rank == world - 1:
        state = make_state(9)
        buffer.begin(9)
        scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
        for bucket in layout.buckets:
            buffer.consume(bucket.index, pack_bucket(layout, bucket.index, state, scratch))
        buffer.commit(9)
    out["mixed"] = outcome(lambda: buffer.gather(group, DEADLINE))
    return out


# -- CUDA IPC control plane (host backend: same state machine, no GPU) ------------------------
def _publish_name(path: str, name: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(name)
    os.replace(tmp, path)


def _read_name(path: str, timeout: float = 60.0) -> str:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no channel name at {path}")
        time.sleep(0.01)
    with open(path) as fh:
        return fh.read()


def scenario_ipc(rank: int, world: int, port: int, path: str, backend: str) -> dict[str, Any]:
    from rlfleet.weightsync import CudaIpcReceiver, CudaIpcSender

    device = "cuda" if backend == "cuda" else "cpu"
    base = {k: v.to(device) for k, v in make_state(0).items()}
    layout = layout_of(base)
    steps: dict[str, Any] = {}
    if rank == 0:
        with CudaIpcSender(layout, world - 1, backend=backend) as sender:  # type: ignore[arg-type]
            _publish_name(path, sender.name)

            def send(sd: Mapping[str, torch.Tensor], version: int) -> Any:
                moved = {k: v.to(device) for k, v in sd.items()} if not isinstance(sd, FlakyMapping) else sd
                return outcome(lambda: sender.send(moved, version, DEADLINE))

            steps["v1"] = send(make_state(1), 1)
            sender.checksums = True
            steps["v2"] = send(make_state(2), 2)
            steps["stale"] = send(make_state(2), 2)
            steps["layout"] = send(make_state(3), 3)
            steps["consumer"] = send(make_state(3), 3)
            steps["v3"] = send(make_state(3), 3)
        return steps
    with CudaIpcReceiver.attach(_read_name(path), rank - 1) as receiver:
        consumer = RecordingConsumer(layout, make_state(0))

        def recv(c: RecordingConsumer) -> dict[str, Any]:
            result = outcome(lambda: receiver.receive(c, DEADLINE))
            result["applied"] = consumer.version
            result["checksum"] = checksum(consumer.weights)
            return result

        for step in ("v1", "v2", "stale"):
            steps[step] = recv(consumer)
        if rank == 2:
            other = dict(make_state(0))
            other["layers.7.w"] = torch.zeros(3, 3)
            steps["layout"] = recv(RecordingConsumer(layout_of(other), other))
        else:
            steps["layout"] = recv(consumer)
        consumer.fail_on = 1 if rank == 2 else None
        steps["consumer"] = recv(consumer)
        consumer.fail_on = None
        steps["v3"] = recv(consumer)
    return steps


def scenario_ipc_kill(rank: int, world: int, port: int, path: str, victim: int) -> dict[str, Any]:
    """The sender (victim 0) or reader 1 (victim 1) SIGKILLs itself during version 2."""
    from rlfleet.weightsync import CudaIpcReceiver, CudaIpcSender

    base = make_state(0)
    layout = layout_of(base)
    if rank == 0:
        with CudaIpcSender(layout, world - 1, backend="host") as sender:
            _publish_name(path, sender.name)
            sender.send(make_state(1), 1, DEADLINE)
            sd: Mapping[str, torch.Tensor] = make_state(2)
            if victim == 0:
                sd = FlakyMapping(sd, "layers.90.w", 1, "kill")
            result = outcome(lambda: sender.send(sd, 2, 20.0))
        return result
    with CudaIpcReceiver.attach(_read_name(path), rank - 1) as receiver:
        consumer = RecordingConsumer(layout, base)
        receiver.receive(consumer, DEADLINE)
        if victim == 1 and rank == 1:

            def die(index: int, data: torch.Tensor) -> None:
                if index == 3:
                    os.kill(os.getpid(), signal.SIGKILL)
                RecordingConsumer.consume(consumer, index, data)

            consumer.consume = die  # type: ignore[method-assign]
        result = outcome(lambda: receiver.receive(consumer, 20.0))
        result["applied"] = consumer.version
        result["checksum"] = checksum(consumer.weights)
    return result
