"""State dicts and process bodies for the shared-memory tests.

Children start from a forkserver that preloaded torch (fork after torch ran parallel ops can
hang in OpenMP; spawn would re-import torch for every child), so their bodies live in this
importable module.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from rlfleet.weightsync import (
    DTYPES,
    Deadline,
    DoubleBuffer,
    Layout,
    SharedBuffer,
    SharedBufferReader,
    SharedSegment,
    ShmRingReceiver,
    ShmRingSender,
    checksum,
    pack_bucket,
)

BUCKET = 64 * 1024
TIMEOUT = 200.0  # generous: the CI machine is small and shared; nothing here asserts on time
#: Prefix family of segments a test leaves behind on purpose (a killed creator) and reclaims
#: itself: outside "rlfleet-..." so that no concurrent run's reclaim of dead rlfleet segments
#: removes them first.
TEST_PREFIX = "rlfleettest"


# -- state dicts ------------------------------------------------------------------------------
def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns (NaN payloads, denormals, every byte value) of any dtype."""
    numel = 1
    for d in shape:
        numel *= d
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def make_state(version: int, small: int = 40) -> dict[str, torch.Tensor]:
    """Every dtype, non-contiguous sources, 0-dim, empty, and a tensor larger than a bucket."""
    g = torch.Generator().manual_seed(7919 * version + 13)
    sd: dict[str, torch.Tensor] = {}
    sd["embed.weight"] = random_tensor((300, 160), torch.bfloat16, g)  # 96000 B > BUCKET: alone
    for name, dtype in DTYPES.items():
        sd[f"dtypes.t_{name}"] = random_tensor((3, 5, 7), dtype, g)
        sd[f"scalars.t_{name}"] = random_tensor((), dtype, g)
    sd["empty"] = torch.zeros(0, 4)
    sd["empty_bf16"] = torch.zeros(5, 0, dtype=torch.bfloat16)
    sd["transposed"] = random_tensor((48, 32), torch.float32, g).t()
    sd["strided"] = random_tensor((64, 10), torch.float16, g)[::3, 1::2]
    sd["step"] = torch.tensor([version], dtype=torch.int64)
    for i in range(small):
        n = 1 + (i * 37) % 900  # sized for >= 5 buckets of 16 KiB with densely packed small tensors
        sd[f"layers.{i}.w"] = random_tensor((n,), torch.bfloat16 if i % 3 else torch.float32, g)
    return sd


def layout_of(sd: Mapping[str, torch.Tensor], bucket: int = BUCKET) -> Layout:
    return Layout.from_state_dict(sd, bucket)


def zeros_like_layout(layout: Layout) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "ComplexHalf support is experimental"
        return {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in layout.tensors}


def module_for(layout: Layout) -> torch.nn.Module:
    """A module whose state dict matches `layout` (float tensors as parameters, others buffers)."""
    module = torch.nn.Module()
    for spec in layout.tensors:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.zeros(spec.shape, dtype=spec.torch_dtype)
        holder = module
        *path, leaf = spec.name.split(".")
        for part in path:
            if not hasattr(holder, part):
                holder.add_module(part, torch.nn.Module())
            holder = getattr(holder, part)
        if tensor.is_floating_point() and tensor.dtype.itemsize > 1:
            holder.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
        else:
            holder.register_buffer(leaf, tensor)
    return module


# -- process plumbing -------------------------------------------------------------------------
_CTX: BaseContext | None = None


def context() -> BaseContext:
    global _CTX
    if _CTX is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "rlfleet.weightsync", "shm_workers"])
        _CTX = ctx
    return _CTX


def report(queue: Any, tag: Any, fn: Callable[[], Any]) -> None:
    """Run fn in a child; put (tag, "ok", value) or (tag, error class name, message) on `queue`."""
    try:
        queue.put((tag, "ok", fn()))
    except BaseException as exc:
        queue.put((tag, type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))


@contextmanager
def processes() -> Iterator[list[BaseProcess]]:
    """Processes started inside are joined (or killed) on the way out, whatever happens."""
    procs: list[BaseProcess] = []
    try:
        yield procs
    finally:
        for proc in procs:
            proc.join(TIMEOUT)
            if proc.is_alive():
                proc.kill()
                proc.join(TIMEOUT)


def start(procs: list[BaseProcess], target: Callable[..., Any], *args: Any) -> BaseProcess:
    proc = context().Process(target=target, args=args, daemon=True)
    proc.start()
    procs.append(proc)
    return proc


# -- ring readers -----------------------------------------------------------------------------
def ring_reader(
    name: str,
    index: int,
    bucket: int,
    versions: int,
    queue: Any,
    gate: tuple[int, int] | None = None,
    at_gate: Any = None,
    go: Any = None,
    initial: int | None = None,
    shape_override: tuple[str, tuple[int, ...]] | None = None,
) -> None:
    """Receive `versions` versions into a DoubleBuffer; report each outcome and checksum.

    With `gate=(version, bucket)`, consuming that bucket signals `at_gate` and waits for `go`.
    With `initial`, start from make_state(initial) applied as that version.
    """
    reference = make_state(1)
    if shape_override is not None:
        changed, shape = shape_override
        reference[changed] = torch.zeros(shape, dtype=reference[changed].dtype)
    layout = layout_of(reference, bucket)
    live = zeros_like_layout(layout)
    buffer = DoubleBuffer(live, layout)
    if initial is not None:
        state = make_state(initial)
        for name_, tensor in live.items():
            tensor.copy_(state[name_])
        buffer._version = initial  # as if version `initial` had been received
    if gate is not None:
        original = buffer.consume

        def gated(k: int, data: torch.Tensor) -> None:
            if (buffer.pending_version, k) == gate:
                at_gate.set()
                go.wait(TIMEOUT)
            original(k, data)

        buffer.consume = gated  # type: ignore[method-assign]
    receiver = ShmRingReceiver.attach(name, index)
    try:
        for _ in range(versions):
            try:
                version = receiver.receive(buffer, TIMEOUT)
                queue.put((index, "ok", (version, checksum(live))))
            except Exception as exc:
                queue.put((index, type(exc).__name__, (str(exc), buffer.version, checksum(live))))
    finally:
        receiver.close()


def ring_sender_then_hang(bucket: int, readers: int, queue: Any, versions: tuple[int, ...]) -> None:
    """Create a ring, publish its name, send `versions` (the test SIGKILLs us during the last)."""
    state = make_state(1)
    sender = ShmRingSender(layout_of(state, bucket), readers, slots=2, prefix=f"{TEST_PREFIX}-ring")
    queue.put(("name", sender.name))
    for version in versions:
        outcome = sender.send(make_state(version), version, TIMEOUT)
        queue.put(("sent", version, outcome))
    threading.Event().wait(TIMEOUT)  # pragma: no cover - killed before


def receive_in_thread(
    receiver: ShmRingReceiver, consumer: Any, deadline: float
) -> tuple[threading.Thread, list[BaseException]]:
    """Start `receiver.receive(consumer, deadline)` in a thread; the errors it raises are collected."""
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(consumer, deadline)
        except Exception as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    return thread, errors


# -- shared buffer readers --------------------------------------------------------------------
def shared_reader(name: str, commands: Any, queue: Any) -> None:
    """Bind a module to a shared buffer; on each command refresh and report where data lives."""
    reader = SharedBufferReader.attach(name, timeout_s=TIMEOUT)
    module = module_for(reader.layout)
    reader.bind_module(module)
    lo, hi = reader.data_range()
    try:
        while True:
            command = commands.get(timeout=TIMEOUT)
            if command == "stop":
                break
            if command == "write":  # must fault: the mapping is read-only
                max(module.parameters(), key=lambda p: p.numel()).data.add_(1)
                continue
            if command == "refresh":  # the newest committed version, whichever it is
                version = reader.refresh(TIMEOUT)
            else:
                version = reader.wait_for_version(int(command), TIMEOUT)
            state = dict(module.state_dict())
            inside = all(lo <= t.data_ptr() < hi for t in state.values() if t.numel())
            queue.put((reader.reader_index, "ok", (version, checksum(state), inside, os.getpid())))
    finally:
        reader.close()


def create_segment_and_die(queue: Any) -> None:
    """Create a segment and exit without any cleanup (as a SIGKILL or an OOM kill would)."""
    segment = SharedSegment.create(4096, prefix=f"{TEST_PREFIX}-dead")  # TEST_PREFIX cleanup covers it
    queue.put(segment.name)
    queue.close()
    queue.join_thread()  # flush the queue's feeder thread before dying
    os.kill(os.getpid(), signal.SIGKILL)


def write_readonly(name: str) -> None:
    """Attach read-only and write: the process must die of SIGSEGV, not corrupt the segment."""
    segment = SharedSegment.attach(name, readonly=True)
    segment.tensor()[0] = 255


def copying_reader(name: str, commands: Any, queue: Any) -> None:
    """Keep private weights (a DoubleBuffer) fed from the node's shared buffer: each command is
    a version to copy out ("stop" ends)."""
    reader = SharedBufferReader.attach(name, timeout_s=TIMEOUT)
    module = module_for(reader.layout)
    buffer = DoubleBuffer(dict(module.state_dict(keep_vars=True)), reader.layout)
    lo, hi = reader.data_range()
    try:
        while (command := commands.get(timeout=TIMEOUT)) != "stop":
            version = int(command)
            try:
                reader.copy_version(version, buffer, TIMEOUT)
            except Exception as exc:  # reported, the process goes on with what it has
                queue.put((version, type(exc).__name__, str(exc), checksum(dict(module.state_dict()))))
                continue
            state = dict(module.state_dict())
            private = all(not lo <= t.data_ptr() < hi for t in state.values() if t.numel())
            queue.put((version, "ok", private, checksum(state)))
    finally:
        reader.close()


# -- shared buffer writers and lock holders -----------------------------------------------------
def stage(buffer: SharedBuffer, version: int, buckets: int, deadline: float | None = None) -> None:
    """begin(version) (under `deadline` if given), then the first `buckets` buckets of
    make_state(version), as a transport would."""
    layout = buffer.layout
    state = make_state(version)
    scratch = torch.empty(max(layout.max_bucket_nbytes, 1), dtype=torch.uint8)
    if deadline is None:
        buffer.begin(version)
    else:
        buffer.begin(version, deadline)
    for bucket in layout.buckets[:buckets]:
        buffer.consume(bucket.index, pack_bucket(layout, bucket.index, state, scratch).clone())


def shared_writer(queue: Any, commands: Any, prefix: str) -> None:
    """The node writer in its own process: ("publish", v) commits make_state(v); ("stage", v, n)
    begins v and stages n buckets, then waits (the test SIGKILLs it mid-publish)."""
    buffer = SharedBuffer(layout_of(make_state(1)), 3, prefix=prefix, timeout_s=TIMEOUT)
    queue.put(("name", buffer.name))
    while (command := commands.get(timeout=TIMEOUT))[0] != "stop":
        if command[0] == "publish":
            buffer.publish(make_state(command[1]), command[1])
        else:
            stage(buffer, command[1], command[2])
        queue.put((command[0], command[1]))
    buffer.close()


def lock_holder(name: str, commands: Any, queue: Any) -> None:
    """A reader stuck in refresh/attach: on "lock" it takes the segment's lock and keeps it
    until "release"; "stop" ends."""
    segment = SharedSegment.attach(name, map_whole=False)
    try:
        while commands.get(timeout=TIMEOUT) == "lock":
            with segment.locked(Deadline(TIMEOUT), "a stuck reader"):
                queue.put("held")
                commands.get(timeout=TIMEOUT)
            queue.put("released")
    finally:
        segment.close()


def make_segments(prefix: str) -> list[SharedBuffer | ShmRingSender | SharedSegment]:
    """One segment of each kind: a node buffer, a ring, a plain segment."""
    layout = layout_of(make_state(1))
    return [
        SharedBuffer(layout, 1, prefix=prefix, reclaim=False),
        ShmRingSender(layout, 1, prefix=prefix),
        SharedSegment.create(4096, prefix=prefix),
    ]


def segment_owner(queue: Any, commands: Any, prefix: str, previous: str) -> None:
    """Create segments, report their names, wait for "exit". `previous`: the SIGTERM/SIGHUP
    handler installed before ("default"; "exit": raises SystemExit(3); "carry_on": returns)."""

    def handler(signum: int, frame: Any) -> None:
        queue.put(("handled", signum))
        if previous == "exit":
            raise SystemExit(3)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        # "default" is set, not inherited: a run started under nohup ignores SIGHUP, and the
        # cleanup rightly leaves an ignored signal alone
        signal.signal(sig, signal.SIG_DFL if previous == "default" else handler)
    made = make_segments(prefix)
    queue.put(("names", [m.name for m in made]))
    while commands.get(timeout=TIMEOUT) != "exit":
        pass


def create_buffer_and_die(queue: Any, prefix: str) -> None:
    """A run whose node writer is SIGKILLed: its segments stay behind."""
    made = make_segments(prefix)
    queue.put([m.name for m in made])
    queue.close()
    queue.join_thread()
    os.kill(os.getpid(), signal.SIGKILL)


def new_run_writer(queue: Any, prefix: str) -> None:
    """The next run on the node: its writer's construction reclaims dead runs' segments."""
    with SharedBuffer(layout_of(make_state(1)), 1, prefix=prefix) as buffer:
        queue.put(buffer.name)
