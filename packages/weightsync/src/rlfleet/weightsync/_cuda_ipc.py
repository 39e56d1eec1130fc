"""CUDA IPC transport (same node, GPU): two ping-pong GPU bucket slots, opened once by readers.

The sender allocates two GPU bucket buffers with CuPy (plain ``cudaMalloc``, so an IPC handle
covers exactly one buffer), exports their IPC handles once (``ipcGetMemHandle``), and readers
open them once (``ipcOpenMemHandle``); torch sees both ends through DLPack, without copies. Per
bucket the sender packs into slot ``k % 2`` (once every reader acknowledged that slot's previous
bucket), synchronizes its stream and publishes the slot's sequence number; a reader hands the
slot to its `BucketConsumer`, synchronizes, and acknowledges. Packing bucket k+1 overlaps the
readers consuming bucket k.

The control plane is a small shared-memory block (`_shm.SharedSegment`): handles (base64 in
JSON) and the sender's layout, per-slot sequence numbers, per-reader liveness and acks, and a
two-phase commit: each reader reports *prepared* or *failed*, and the sender then writes
*commit* only if every reader prepared, else *abort*, so a version lands on all readers or on
none. Waits poll under a `Deadline` and check the peer's liveness (pid + start time): a dead
peer is a `PeerLostError`, a stuck one a `SyncTimeoutError`.

``backend="host"`` swaps the GPU slots for a shared-memory segment with the same control
plane; it exists so the whole state machine runs, across real processes, on machines without
a GPU (the tests), and is not a CPU transport of its own (that is `ShmRingSender`).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack

from rlfleet.weightsync._cupy import import_cupy
from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    SyncAbortedError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync._integrity import bucket_checksum
from rlfleet.weightsync._json import decode_json
from rlfleet.weightsync._layout import MAX_METADATA_BYTES, Layout
from rlfleet.weightsync._packing import pack_bucket
from rlfleet.weightsync._protocol import BucketConsumer
from rlfleet.weightsync._shm import (
    SHM_DIR,
    SharedSegment,
    memory_fence,
    page_align,
    process_alive,
    process_identity,
    segment_creator,
)

__all__ = ["ControlBlock", "CudaIpcReceiver", "CudaIpcSender"]

Backend = Literal["cuda", "host"]

MAGIC = 0x524C46_495043  # "RLF" "IPC"
FORMAT = 1
NUM_SLOTS = 2
MAX_READERS = 1024
LIVENESS_PERIOD_S = 0.005
#: How long `CudaIpcSender.close` waits for readers to close their IPC mappings before freeing
#: the slots (CUDA: cudaFree of an exported region before the importer's cudaIpcCloseMemHandle
#: is undefined behaviour).
DETACH_WAIT_S = 5.0

_log = logging.getLogger(__name__)

# Global words (int64).
G_MAGIC, G_FORMAT, G_WRITER_PID, G_WRITER_START = 0, 1, 2, 3
G_READERS, G_SLOT_BYTES, G_META_LEN, G_META_OFFSET = 4, 5, 6, 7
G_SESSION, G_VERSION, G_NBUCKETS, G_BASE = 8, 9, 10, 11
G_COMMIT, G_ABORT, G_CLOSED, G_CHECKSUMS = 12, 13, 14, 15
SLOT_BASE = 16
SLOT_WORDS = 4
S_SEQ, S_BUCKET, S_NBYTES, S_CRC = 0, 1, 2, 3
READER_WORDS = 8
R_PID, R_START, R_ATTACHED, R_ACK, R_PREPARED, R_RESULT, R_DONE, R_EPOCH = range(8)
RESULT_OK, RESULT_FAILED = 1, 2


def _words(num_readers: int) -> int:
    return SLOT_BASE + SLOT_WORDS * NUM_SLOTS + READER_WORDS * num_readers


class ControlBlock:
    """The shared words of one IPC channel (int64 array in shared memory) and their meaning."""

    def __init__(self, words: np.ndarray, num_readers: int) -> None:
        self.h = words
        self.num_readers = num_readers

    def slot(self, j: int, field: int) -> int:
        return SLOT_BASE + SLOT_WORDS * j + field

    def reader(self, i: int, field: int) -> int:
        return SLOT_BASE + SLOT_WORDS * NUM_SLOTS + READER_WORDS * i + field

    def get(self, word: int) -> int:
        return int(self.h[word])

    def set(self, word: int, value: int) -> None:
        self.h[word] = value

    def reader_alive(self, i: int) -> bool:
        return process_alive(self.get(self.reader(i, R_PID)), self.get(self.reader(i, R_START)))

    def writer_alive(self) -> bool:
        return process_alive(self.get(G_WRITER_PID), self.get(G_WRITER_START))


class _Every:
    """Rate limit for liveness probes (each reads /proc)."""

    def __init__(self, period: float = LIVENESS_PERIOD_S) -> None:
        self.period = period
        self._next = 0.0

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period
        return True


# -- slot backends ------------------------------------------------------------------------------
class _CudaSlots:
    """Two cudaMalloc'ed buffers (CuPy) viewed as torch tensors; handles exported once."""

    kind = "cuda"

    def __init__(self, nbytes: int, device: torch.device) -> None:
        cp = import_cupy()
        self.device = device
        self.nbytes = nbytes
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device_index = index
        with cp.cuda.Device(index):
            self._mems = [cp.cuda.Memory(nbytes) for _ in range(NUM_SLOTS)]
            arrays = [
                cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(m, 0)) for m in self._mems
            ]
            self.tensors = [from_dlpack(a) for a in arrays]
            self.handles = [
                base64.b64encode(bytes(cp.cuda.runtime.ipcGetMemHandle(m.ptr))).decode() for m in self._mems
            ]

    def sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.tensors = []
        self._mems = []


class _CudaOpened:
    """A reader's view of the sender's slots: IPC handles opened once, closed on `close`."""

    kind = "cuda"

    def __init__(self, handles: list[str], nbytes: int, device: torch.device) -> None:
        cp = import_cupy()
        self._cp = cp
        self.device = device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._index = index
        flag = getattr(cp.cuda.runtime, "cudaIpcMemLazyEnablePeerAccess", 1)
        self._ptrs: list[int] = []
        self.tensors: list[torch.Tensor] = []
        with cp.cuda.Device(index):
            try:
                for handle in handles:
                    ptr = cp.cuda.runtime.ipcOpenMemHandle(base64.b64decode(handle), flag)
                    self._ptrs.append(ptr)
                    mem = cp.cuda.UnownedMemory(ptr, nbytes, None, index)
                    arr = cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
                    self.tensors.append(from_dlpack(arr))
            except BaseException:
                self.close()
                raise

    def sync(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.tensors = []
        ptrs, self._ptrs = self._ptrs, []  # each mapping is closed once, even if a close fails
        if not ptrs:
            return
        with contextlib.suppress(Exception), self._cp.cuda.Device(self._index):  # the opening context
            for ptr in ptrs:
                with contextlib.suppress(Exception):  # the context may be tearing down already
                    self._cp.cuda.runtime.ipcCloseMemHandle(ptr)


class _HostSlots:
    """CPU stand-in for the GPU slots: one shared-memory segment; its name is the "handle"."""

    kind = "host"

    def __init__(self, nbytes: int) -> None:
        self.nbytes = page_align(nbytes)
        self._segment = SharedSegment.create(self.nbytes * NUM_SLOTS, prefix="rlfleet-ipcslots")
        self.tensors = [self._segment.tensor(j * self.nbytes, self.nbytes) for j in range(NUM_SLOTS)]
        self.handles = [self._segment.name]

    def sync(self) -> None:
        memory_fence()

    def close(self) -> None:
        self.tensors = []
        self._segment.close()
        self._segment.unlink()


class _HostOpened:
    kind = "host"

    def __init__(self, handles: list[str], nbytes: int) -> None:
        if len(handles) != 1:
            raise MetadataError(f"host slots carry one segment name, got {len(handles)}")
        self.name = handles[0]
        self._segment = SharedSegment.attach(handles[0], readonly=True)
        stride = page_align(nbytes)
        self.tensors = [self._segment.tensor(j * stride, nbytes) for j in range(NUM_SLOTS)]

    def sync(self) -> None:
        memory_fence()

    def close(self) -> None:
        self.tensors = []
        self._segment.close()


# -- sender -------------------------------------------------------------------------------------
class CudaIpcSender:
    """Writer of one IPC channel to `num_readers` same-node readers.

    ``send(state_dict, version, deadline)`` returns once every reader committed, or raises
    (and no reader applies anything). Readers join with ``CudaIpcReceiver.attach(sender.name,
    index)``; the slots and handles are made once, here.
    """

    def __init__(
        self,
        layout: Layout,
        num_readers: int,
        device: str | torch.device | None = None,
        checksums: bool = False,
        backend: Backend = "cuda",
    ) -> None:
        if (
            isinstance(num_readers, bool)
            or not isinstance(num_readers, int)
            or not 1 <= num_readers <= MAX_READERS
        ):
            raise ValueError(f"num_readers must be an int in [1, {MAX_READERS}], got {num_readers!r}")
        self.layout = layout
        self.num_readers = num_readers
        self.checksums = checksums
        slot_bytes = max(layout.max_bucket_nbytes, 1)
        self._slots: _CudaSlots | _HostSlots
        if backend == "cuda":
            import_cupy()  # first: without CuPy the error must name the extras, not the driver
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self.device = torch.device(device)
            self._slots = _CudaSlots(slot_bytes, self.device)
            device_index = self._slots.device_index
        elif backend == "host":
            self.device = torch.device("cpu")
            self._slots = _HostSlots(slot_bytes)
            device_index = -1
        else:
            raise ValueError(f"backend must be 'cuda' or 'host', got {backend!r}")
        meta = json.dumps(
            {
                "backend": backend,
                "handles": self._slots.handles,
                "slot_bytes": slot_bytes,
                "device": device_index,
                "layout": layout.to_dict(),
            },
            separators=(",", ":"),
        ).encode()
        words = _words(num_readers)
        meta_offset = (words * 8 + 63) // 64 * 64
        try:
            self._segment = SharedSegment.create(page_align(meta_offset + len(meta)), prefix="rlfleet-ipc")
        except BaseException:
            self._slots.close()
            raise
        buf = self._segment.buffer
        buf[meta_offset : meta_offset + len(meta)] = meta
        self._cb = ControlBlock(np.frombuffer(buf, dtype=np.int64, count=words), num_readers)
        cb = self._cb
        pid, start = process_identity()
        for word, value in (
            (G_FORMAT, FORMAT),
            (G_WRITER_PID, pid),
            (G_WRITER_START, start),
            (G_READERS, num_readers),
            (G_SLOT_BYTES, slot_bytes),
            (G_META_LEN, len(meta)),
            (G_META_OFFSET, meta_offset),
            (G_CHECKSUMS, int(checksums)),
        ):
            cb.set(word, value)
        memory_fence()
        cb.set(G_MAGIC, MAGIC)
        self._published = 0
        self._session = 0
        self._liveness = _Every()

    @property
    def name(self) -> str:
        """Hand this to readers (`CudaIpcReceiver.attach`)."""
        return self._segment.name

    @property
    def slots(self) -> list[torch.Tensor]:
        return self._slots.tensors

    def _check_readers(self, what: str, force: bool = False) -> None:
        if not (force or self._liveness.due()):
            return
        cb = self._cb
        for i in range(self.num_readers):
            if cb.get(cb.reader(i, R_ATTACHED)) and not cb.reader_alive(i):
                pid = cb.get(cb.reader(i, R_PID))
                raise PeerLostError(f"IPC channel {self.name}: reader {i} (pid {pid}) died while {what}")

    def _poll(self, done: Any, deadline: Deadline, what: str) -> None:
        backoff = Backoff()
        while not done():
            self._check_readers(what)
            if deadline.expired:
                raise deadline.error(f"IPC channel {self.name}: {what}")
            backoff.sleep(deadline.remaining())

    def wait_attached(self, deadline: Deadline | float | None = None) -> None:
        """Block until every reader has attached (opened the handles)."""
        deadline = Deadline.coerce(deadline)
        cb = self._cb

        def missing() -> list[int]:
            return [i for i in range(self.num_readers) if not cb.get(cb.reader(i, R_ATTACHED))]

        self._poll(lambda: not missing(), deadline, "waiting for readers to attach")

    def send(
        self, state_dict: Mapping[str, torch.Tensor], version: int, deadline: Deadline | float | None = None
    ) -> int:
        """Send `version`; returns the bytes moved once every reader committed it."""
        deadline = Deadline.coerce(deadline)
        cb = self._cb
        if cb.get(G_CLOSED):
            raise WeightSyncError(f"IPC channel {self.name} is closed")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"version must be an int, got {version!r}")
        self.layout.check_state_dict(state_dict)
        self.wait_attached(deadline)
        self._check_readers("starting a version", force=True)
        session = self._session + 1
        base = self._published
        nbuckets = len(self.layout.buckets)
        self._session = session
        self._published = base + nbuckets
        cb.set(G_VERSION, version)
        cb.set(G_NBUCKETS, nbuckets)
        cb.set(G_BASE, base)
        cb.set(G_CHECKSUMS, int(self.checksums))
        memory_fence()
        cb.set(G_SESSION, session)
        total = 0
        try:
            with torch.no_grad():
                for k in range(nbuckets):
                    j = k % NUM_SLOTS
                    previous = cb.get(cb.slot(j, S_SEQ))
                    self._poll(
                        lambda previous=previous: self._slot_free(previous, session, base),
                        deadline,
                        f"waiting for readers to release slot {j} (version {version})",
                    )
                    if self._failed(session):
                        break  # a reader gave up: stop, and abort the others below
                    data = pack_bucket(self.layout, k, state_dict, self._slots.tensors[j])
                    if self.checksums:
                        cb.set(cb.slot(j, S_CRC), bucket_checksum(data))
                    self._slots.sync()  # the bytes are in the slot before the sequence number says so
                    cb.set(cb.slot(j, S_BUCKET), k)
                    cb.set(cb.slot(j, S_NBYTES), data.numel())
                    memory_fence()
                    cb.set(cb.slot(j, S_SEQ), base + k + 1)
                    total += data.numel()
            failed = self._failed(session)
            if failed:
                cb.set(G_ABORT, session)  # the others stop waiting for buckets that will not come
            self._poll(
                lambda: self._all_prepared(session), deadline, f"waiting for readers to prepare {version}"
            )
            failed = failed or self._failed(session)
            if failed:
                cb.set(G_ABORT, session)
                raise SyncAbortedError(
                    f"version {version} aborted, nothing applied: reader(s) {failed} failed to take it"
                )
            memory_fence()
            cb.set(G_COMMIT, session)
            self._poll(
                lambda: all(cb.get(cb.reader(i, R_DONE)) == session for i in range(self.num_readers)),
                deadline,
                f"waiting for readers to commit {version}",
            )
        except BaseException:
            if cb.get(G_COMMIT) != session:
                cb.set(G_ABORT, session)
            raise
        return total

    def _slot_free(self, previous: int, session: int, base: int) -> bool:
        """Every reader is done with the bucket the slot held (or that bucket is from an old session)."""
        if previous <= base:
            return True
        cb = self._cb
        return all(
            cb.get(cb.reader(i, R_ACK)) >= previous or cb.get(cb.reader(i, R_PREPARED)) == session
            for i in range(self.num_readers)
        )

    def _failed(self, session: int) -> list[int]:
        cb = self._cb
        return [
            i
            for i in range(self.num_readers)
            if cb.get(cb.reader(i, R_PREPARED)) == session and cb.get(cb.reader(i, R_RESULT)) == RESULT_FAILED
        ]

    def _all_prepared(self, session: int) -> bool:
        cb = self._cb
        return all(cb.get(cb.reader(i, R_PREPARED)) == session for i in range(self.num_readers))

    def close(self) -> None:
        """Tell readers the channel is gone; free the slots and the control block.

        With CUDA slots, first wait (up to `DETACH_WAIT_S`) for live readers to close their IPC
        mappings: CUDA leaves freeing an exported region that another process still has open
        undefined.
        """
        if self._segment.closed:
            return
        self._cb.set(G_CLOSED, 1)
        if self._slots.kind == "cuda":
            self._wait_detached(DETACH_WAIT_S)
        self._cb.h = np.zeros(1, dtype=np.int64)
        self._segment.close()
        self._segment.unlink()
        self._slots.close()

    def _wait_detached(self, seconds: float) -> None:
        cb = self._cb

        def attached() -> list[int]:
            return [
                i for i in range(self.num_readers) if cb.get(cb.reader(i, R_ATTACHED)) and cb.reader_alive(i)
            ]

        end = time.monotonic() + seconds
        backoff = Backoff(initial=1e-3, maximum=50e-3)
        while (left := attached()) and time.monotonic() < end:
            backoff.sleep(end - time.monotonic())
        if left:
            _log.warning(
                "IPC channel %s: reader(s) %s still had the CUDA slots open after %.1fs; freeing them anyway",
                self.name,
                left,
                seconds,
            )

    def __enter__(self) -> CudaIpcSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- receiver -----------------------------------------------------------------------------------
class CudaIpcReceiver:
    """One reader of an IPC channel: ``receive(consumer, deadline)`` once per version."""

    def __init__(
        self,
        segment: SharedSegment,
        cb: ControlBlock,
        index: int,
        slots: _CudaOpened | _HostOpened,
        sender_layout: Layout,
        last_session: int,
    ) -> None:
        self._segment = segment
        self._cb = cb
        self.index = index
        self._slots = slots
        self.sender_layout = sender_layout
        # Read before R_ATTACHED is set (see ShmRingReceiver): a session started after that
        # includes this reader and must not be taken for an old one.
        self._last_session = last_session
        self._liveness = _Every()

    @property
    def name(self) -> str:
        return self._segment.name

    @classmethod
    def attach(cls, name: str, index: int, device: str | torch.device | None = None) -> CudaIpcReceiver:
        """Join channel `name` as reader `index`: open the slot handles once."""
        segment = SharedSegment.attach(name)
        try:
            first = np.frombuffer(segment.buffer, dtype=np.int64, count=SLOT_BASE).copy()
            if first[G_MAGIC] != MAGIC or first[G_FORMAT] != FORMAT:
                raise MetadataError(f"{name!r} is not an rlfleet IPC channel of format {FORMAT}")
            num_readers = int(first[G_READERS])
            meta_offset, meta_len = int(first[G_META_OFFSET]), int(first[G_META_LEN])
            if (
                not 1 <= num_readers <= MAX_READERS
                or meta_offset < _words(num_readers) * 8
                or not 0 < meta_len <= MAX_METADATA_BYTES
                or meta_offset + meta_len > segment.size
            ):
                raise MetadataError(f"IPC channel {name!r} has an inconsistent header")
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < num_readers:
                raise ValueError(f"reader index {index!r} out of range: channel {name!r} has {num_readers}")
            meta = _decode_meta(bytes(segment.buffer[meta_offset : meta_offset + meta_len]))
            cb = ControlBlock(
                np.frombuffer(segment.buffer, dtype=np.int64, count=_words(num_readers)), num_readers
            )
            holder = cb.get(cb.reader(index, R_PID))
            me, my_start = process_identity()
            if cb.get(cb.reader(index, R_ATTACHED)) and holder != me and cb.reader_alive(index):
                raise WeightSyncError(
                    f"IPC channel {name!r}: reader index {index} is held by live pid {holder}"
                )
            slots: _CudaOpened | _HostOpened
            if meta["backend"] == "cuda":
                if (cb.get(G_WRITER_PID), cb.get(G_WRITER_START)) == (me, my_start):
                    # CUDA cannot open an IPC handle in the process that exported it.
                    raise WeightSyncError(
                        f"IPC channel {name!r}: CUDA slots must be attached from another process "
                        "than the sender's"
                    )
                import_cupy()
                dev = (
                    torch.device(device)
                    if device is not None
                    else torch.device("cuda", torch.cuda.current_device())
                )
                slots = _CudaOpened(meta["handles"], meta["slot_bytes"], dev)
            else:
                slots = _HostOpened(meta["handles"], meta["slot_bytes"])
            cb.set(cb.reader(index, R_ATTACHED), 0)
            cb.set(cb.reader(index, R_PID), me)
            cb.set(cb.reader(index, R_START), my_start)
            cb.set(cb.reader(index, R_ACK), 0)
            cb.set(cb.reader(index, R_EPOCH), cb.get(cb.reader(index, R_EPOCH)) + 1)
            last_session = cb.get(G_SESSION)
            memory_fence()
            cb.set(cb.reader(index, R_ATTACHED), 1)
            return cls(segment, cb, index, slots, meta["layout"], last_session)
        except BaseException:
            segment.close()
            raise

    def _check_writer(self, what: str) -> None:
        cb = self._cb
        if cb.get(G_CLOSED):
            raise PeerLostError(f"IPC channel {self.name} was closed by its sender while {what}")
        if self._liveness.due() and not cb.writer_alive():
            self._unlink_orphans()
            raise PeerLostError(f"IPC sender (pid {cb.get(G_WRITER_PID)}) died while {what}")

    def _unlink_orphans(self) -> None:
        """The sender died without unlinking its segments: remove their names (mappings stay valid)."""
        names = [self._segment.name]
        if isinstance(self._slots, _HostOpened):
            names.append(self._slots.name)
        for name in names:
            creator = segment_creator(name)
            if creator is not None and not process_alive(*creator):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SHM_DIR / name)

    def _wait(self, done: Any, session: int | None, deadline: Deadline, what: str) -> None:
        cb = self._cb
        backoff = Backoff()
        while not done():
            if session is not None and cb.get(G_ABORT) == session:
                raise SyncAbortedError(
                    f"IPC channel {self.name}: the sender aborted while we waited for {what}"
                )
            self._check_writer(f"waiting for {what}")
            if deadline.expired:
                raise deadline.error(f"IPC channel {self.name}: reader {self.index} waiting for {what}")
            backoff.sleep(deadline.remaining())

    def receive(self, consumer: BucketConsumer, deadline: Deadline | float | None = None) -> int:
        """Receive the next version into `consumer`; returns it once committed on every reader."""
        deadline = Deadline.coerce(deadline)
        cb, me = self._cb, self.index
        self._wait(lambda: cb.get(G_SESSION) > self._last_session, None, deadline, "the next version")
        memory_fence()
        session = cb.get(G_SESSION)
        self._last_session = session
        version, base, nbuckets = cb.get(G_VERSION), cb.get(G_BASE), cb.get(G_NBUCKETS)
        began = False
        failure: BaseException | None = None
        try:
            problem = consumer.layout.diff(self.sender_layout)
            if problem is not None:
                name = problem.split("'")[1] if "'" in problem else None
                raise LayoutMismatchError(
                    f"IPC channel {self.name}: layout mismatch with the sender: {problem}", name
                )
            if nbuckets != len(consumer.layout.buckets):
                raise MetadataError(f"session has {nbuckets} buckets, layout {len(consumer.layout.buckets)}")
            consumer.begin(version)
            began = True
            checksums = bool(cb.get(G_CHECKSUMS))
            with torch.no_grad():
                for k in range(nbuckets):
                    j = k % NUM_SLOTS
                    seq = base + k + 1
                    self._wait(
                        lambda j=j, seq=seq: cb.get(cb.slot(j, S_SEQ)) == seq,
                        session,
                        deadline,
                        f"bucket {k} of version {version}",
                    )
                    memory_fence()
                    nbytes = cb.get(cb.slot(j, S_NBYTES))
                    if cb.get(cb.slot(j, S_BUCKET)) != k or nbytes != consumer.layout.buckets[k].nbytes:
                        raise MetadataError(f"IPC channel {self.name}: slot {j} does not hold bucket {k}")
                    data = self._slots.tensors[j][:nbytes]
                    if checksums:
                        expected, actual = cb.get(cb.slot(j, S_CRC)), bucket_checksum(data)
                        if actual != expected:
                            raise ChecksumMismatchError(
                                f"bucket {k} of version {version}: crc32 {actual:#010x}, "
                                f"sender {expected:#010x}",
                                k,
                            )
                    consumer.consume(k, data)
                    self._slots.sync()  # done reading the slot before releasing it
                    cb.set(cb.reader(me, R_ACK), seq)
        except (PeerLostError, SyncAbortedError) as exc:
            if began:
                _abort(consumer, exc)
            self._report(session, base + nbuckets, RESULT_FAILED)
            raise
        except BaseException as exc:
            failure = exc
        if failure is not None:
            if began:
                _abort(consumer, failure)
            self._report(session, base + nbuckets, RESULT_FAILED)
            if isinstance(failure, (WeightSyncError, VersionError)):
                raise failure
            raise SyncAbortedError(f"reader {me} failed on version {version}: {failure}") from failure
        self._report(session, base + nbuckets, RESULT_OK)
        try:
            self._wait(
                lambda: cb.get(G_COMMIT) == session, session, deadline, f"the commit of version {version}"
            )
        except BaseException as exc:
            _abort(consumer, exc)
            raise
        try:
            consumer.commit(version)
        finally:
            cb.set(cb.reader(me, R_DONE), session)
        return version

    def _report(self, session: int, last_seq: int, result: int) -> None:
        cb, me = self._cb, self.index
        cb.set(cb.reader(me, R_ACK), last_seq)  # release every slot of this session
        cb.set(cb.reader(me, R_RESULT), result)
        memory_fence()
        cb.set(cb.reader(me, R_PREPARED), session)
        if result == RESULT_FAILED:
            cb.set(cb.reader(me, R_DONE), session)

    def close(self) -> None:
        """Leave the channel and close the opened handles."""
        if self._segment.closed:
            return
        cb = self._cb
        self._slots.close()  # unmap first: the sender frees CUDA slots once no reader is attached
        cb.set(cb.reader(self.index, R_ATTACHED), 0)
        cb.set(cb.reader(self.index, R_PID), 0)
        cb.h = np.zeros(1, dtype=np.int64)
        self._segment.close()

    def __enter__(self) -> CudaIpcReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _abort(consumer: BucketConsumer, error: BaseException) -> None:
    try:
        consumer.abort(error)
    except Exception:  # the consumer's cleanup must not hide the sync's error
        import logging

        logging.getLogger(__name__).exception("consumer.abort failed")


def _decode_meta(raw: bytes) -> dict[str, Any]:
    data = decode_json(raw, "IPC channel metadata")
    if not isinstance(data, dict):
        raise MetadataError("IPC channel metadata must be a JSON object")
    backend = data.get("backend")
    handles = data.get("handles")
    slot_bytes = data.get("slot_bytes")
    if backend not in ("cuda", "host"):
        raise MetadataError(f"IPC channel backend must be 'cuda' or 'host', got {backend!r:.40}")
    if not isinstance(handles, list) or not all(isinstance(h, str) and len(h) <= 512 for h in handles):
        raise MetadataError("IPC channel handles must be a list of short strings")
    if backend == "cuda" and len(handles) != NUM_SLOTS:
        raise MetadataError(f"IPC channel must carry {NUM_SLOTS} CUDA handles, got {len(handles)}")
    if not isinstance(slot_bytes, int) or isinstance(slot_bytes, bool) or not 0 < slot_bytes <= 1 << 44:
        raise MetadataError(f"IPC channel slot_bytes is invalid: {slot_bytes!r:.40}")
    return {
        "backend": backend,
        "handles": handles,
        "slot_bytes": slot_bytes,
        "layout": Layout.from_dict(data.get("layout")),
    }
