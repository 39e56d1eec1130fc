"""The writer of a CUDA IPC channel (see `_cuda_ipc` for the protocol and the stream contract).

With ``delta="auto"`` the writer keeps a base (`codec.DeltaEncoder`: the last version that
committed, one copy in the wire dtype on the host) and offers it with each session: every reader
reports whether its consumer holds that version (`codec.holds_base`), and when all do, each slot
carries its bucket's delta (kind and the digest of the new bucket in the slot record) instead of
its bytes; one reader without the base makes the version full for all (a slot is read by every
reader). On GPU slots the encode runs on a host copy of each packed bucket (copied down, the
small delta copied back into the slot): the same codec as the ShmRing, no kernels of its own.
A version lands on all readers or on none, so a reader that refuses a delta (its rebuild fails
the digest) aborts the version for all; the base is then forgotten and the next version is full.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Literal

import torch

import rlfleet.weightsync.cuda._ipc_control as ipc
from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import PeerLostError, SlotsStillMappedError, SyncAbortedError, WeightSyncError
from rlfleet.weightsync.codec._delta import DEFAULT_MAX_FRACTION, DELTA_KINDS, FULL
from rlfleet.weightsync.codec._delta_state import DeltaEncoder, check_delta_mode
from rlfleet.weightsync.cuda._cupy import import_cupy
from rlfleet.weightsync.cuda._ipc_control import ChannelBlock
from rlfleet.weightsync.cuda._ipc_slots import CudaSlots, HostSlots
from rlfleet.weightsync.layout._integrity import bucket_checksum
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import pack_bucket
from rlfleet.weightsync.protocol._stream import (
    Source,
    StreamCursor,
    Weights,
    drain_on_error,
    fill_bucket,
    open_source,
)
from rlfleet.weightsync.shm._control_block import Every, require_int_in
from rlfleet.weightsync.shm._ring_format import digest_word
from rlfleet.weightsync.shm._shm import memory_fence

__all__ = ["DETACH_WAIT_S", "CudaIpcSender", "free_retired_slots"]

Backend = Literal["cuda", "host"]

#: How long `CudaIpcSender.close` waits for live readers to unmap the slots before it leaks them
#: (CUDA: freeing an exported region while another process still maps it is undefined).
DETACH_WAIT_S = 5.0
DEFAULT_SEND_DEADLINE_S = 120.0

_log = logging.getLogger(__name__)

#: Closed senders whose slots a live reader still mapped: kept alive (their slots allocated) until
#: `free_slots` finds no reader left; each new sender looks again.
_RETIRED: set[CudaIpcSender] = set()


def free_retired_slots() -> int:
    """Free the slots of every closed channel of this process that no live reader maps any
    more; how many slot buffers are still kept."""
    for sender in list(_RETIRED):
        sender.free_slots()
    return sum(sender.held_slots for sender in list(_RETIRED))


class CudaIpcSender:
    """Writer of one IPC channel to `num_readers` same-node readers.

    ``send(weights, version, deadline)`` returns once every reader committed, or raises (and
    no reader applies anything); `weights` is a state dict or a `WeightStream` (pairs in the
    layout's order, each copied into its slot as it comes; drained after a failure). Readers
    join with ``CudaIpcReceiver.attach(sender.name, index)``; the slots and handles are made
    once, here. `close` frees the slots once no live reader maps them (`free_slots`).
    ``delta="auto"`` sends a version as its delta from the last committed one when every reader
    holds that (see the module; `delta.last` says what the last version sent, `last_full_readers`
    which readers lacked the base); ``delta_max_fraction``: a bucket whose delta is not smaller
    than that fraction of it goes full.
    """

    #: Readers that lacked the offered base in the last session (the version then went full).
    last_full_readers: tuple[int, ...] = ()

    def __init__(
        self,
        layout: Layout,
        num_readers: int,
        device: str | torch.device | None = None,
        checksums: bool = False,
        backend: Backend = "cuda",
        detach_timeout_s: float = DETACH_WAIT_S,
        *,
        delta: str = "off",
        delta_max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        require_int_in("num_readers", num_readers, 1, ipc.MAX_READERS)
        if not detach_timeout_s >= 0:
            raise ValueError(f"detach_timeout_s must be >= 0, got {detach_timeout_s!r}")
        #: The base and per-bucket delta choice (None: ``delta="off"``, every version full).
        self.delta: DeltaEncoder | None = (
            None if check_delta_mode(delta) == "off" else DeltaEncoder(layout, delta, delta_max_fraction)
        )
        self.layout = layout
        self.num_readers = num_readers
        self.checksums = checksums
        self.detach_timeout_s = float(detach_timeout_s)
        slot_bytes = max(layout.max_bucket_nbytes, 1)
        self._slots: CudaSlots | HostSlots
        if backend == "cuda":
            import_cupy()  # first: without CuPy the error must name the extras, not the driver
            if device is None:
                device = torch.device("cuda", torch.cuda.current_device())
            self._slots = CudaSlots(slot_bytes, torch.device(device))
            self.device = self._slots.device
            device_index = self._slots.device_index
        elif backend == "host":
            self.device = torch.device("cpu")
            self._slots = HostSlots(slot_bytes)
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
        try:
            self._segment, self._cb = ChannelBlock.create(meta, num_readers, slot_bytes, checksums)
        except BaseException:
            self._slots.close()
            raise
        self._published = 0
        self._session = 0
        self._liveness = Every()
        self._closed = False
        self._freed = False
        free_retired_slots()  # a reader of an earlier channel may have left since

    @property
    def name(self) -> str:
        """Hand this to readers (`CudaIpcReceiver.attach`)."""
        return self._segment.name

    @property
    def slots(self) -> list[torch.Tensor]:
        return self._slots.tensors

    @property
    def held_slots(self) -> int:
        """Slot buffers still allocated: both until `close` could free them, then none."""
        return 0 if self._freed else ipc.NUM_SLOTS

    def _check_readers(self, what: Callable[[], str] | str, force: bool = False) -> None:
        if not (force or self._liveness.due()):
            return
        cb = self._cb
        for i in range(self.num_readers):
            if cb.get(cb.reader(i, ipc.R_ATTACHED)) and not cb.reader_alive(i):
                pid = cb.get(cb.reader(i, ipc.R_PID))
                raise PeerLostError(
                    f"IPC channel {self.name}: reader {i} (pid {pid}) died while {_text(what)}"
                )

    def _poll(self, done: Callable[[], bool], deadline: Deadline, what: Callable[[], str] | str) -> None:
        backoff = Backoff()
        while not done():
            self._check_readers(what)
            if deadline.expired:
                raise deadline.error(f"IPC channel {self.name}: {_text(what)}")
            backoff.sleep(deadline.remaining())

    def wait_attached(self, deadline: Deadline | float | None = DEFAULT_SEND_DEADLINE_S) -> None:
        """Block until every reader has attached (opened the handles)."""
        deadline = Deadline.coerce(deadline)
        cb = self._cb

        def missing() -> list[int]:
            return [i for i in range(self.num_readers) if not cb.get(cb.reader(i, ipc.R_ATTACHED))]

        self._poll(lambda: not missing(), deadline, lambda: f"waiting for reader(s) {missing()} to attach")

    def send(
        self,
        weights: Weights,
        version: int,
        deadline: Deadline | float | None = DEFAULT_SEND_DEADLINE_S,
    ) -> int:
        """Send `version`; returns the bytes moved once every reader committed it."""
        deadline = Deadline.coerce(deadline)
        source = open_source(weights, self.layout)
        with drain_on_error(source, deadline):
            return self._send(source, version, deadline)

    def _send(self, source: Source, version: int, deadline: Deadline) -> int:
        cb = self._cb
        if self._closed or cb.get(ipc.G_CLOSED):
            raise WeightSyncError(f"IPC channel {self.name} is closed")
        if isinstance(version, bool) or not isinstance(version, int) or not -(1 << 63) <= version < 1 << 63:
            raise ValueError(f"version must be an int64, got {version!r}")
        if not isinstance(source, StreamCursor):  # a stream is checked as it is read
            self.layout.check_state_dict(source, sending=True)
        self.wait_attached(deadline)
        self._check_readers("starting a version", force=True)
        session = self._session + 1
        base = self._published
        nbuckets = len(self.layout.buckets)
        self._session = session
        self._published = base + nbuckets
        cb.set(ipc.G_SESSION, session)  # every earlier session is over
        memory_fence()  # then look for their readers (a reader sets R_READING, then looks here)
        offer = None if self.delta is None else self.delta.offer()
        try:
            self._poll(
                lambda: not cb.stragglers(session),
                deadline,
                lambda: (
                    f"waiting for reader(s) {cb.stragglers(session)} to stop reading the slots "
                    f"of an aborted version before version {version} rewrites them"
                ),
            )
            header = {ipc.G_VERSION: version, ipc.G_NBUCKETS: nbuckets, ipc.G_BASE: base}
            header[ipc.G_OFFER] = -1 if offer is None else offer
            for word, value in header.items():
                cb.set(word, value)
            cb.set(ipc.G_CHECKSUMS, int(self.checksums))
            memory_fence()
            cb.set(ipc.G_READY, session)  # the header: readers take the session from here
            delta = self._start_delta(version, session, offer, deadline)
            total = self._send_buckets(source, version, session, base, deadline, delta)
            self._vote(version, session, deadline)
        except BaseException:
            if cb.get(ipc.G_COMMIT) != session:
                cb.set(ipc.G_ABORT, session)
            raise
        finally:
            if self.delta is not None:  # committed: every bucket went out, the base is this version
                self.delta.finish(version, cb.get(ipc.G_COMMIT) == session)
        return total

    def _start_delta(self, version: int, session: int, offer: int | None, deadline: Deadline) -> bool:
        """Whether this version goes as deltas: every reader holds the offered base."""
        if self.delta is None:
            return False
        lacking = [] if offer is None else self._wait_reports(session, offer, deadline)
        self.last_full_readers = tuple(lacking)
        delta = offer is not None and not lacking
        self.delta.start(version, delta)
        return delta

    def _wait_reports(self, session: int, offer: int, deadline: Deadline) -> list[int]:
        """Every reader's report of the base it holds for `session`; the readers that lack `offer`
        (one that failed the session before reporting lacks it)."""
        cb = self._cb
        reports: dict[int, bool] = {}

        def all_reported() -> bool:
            for i in range(self.num_readers):
                if i in reports:
                    continue
                if cb.get(cb.reader(i, ipc.R_HELD_SESSION)) == session:
                    memory_fence()
                    reports[i] = cb.get(cb.reader(i, ipc.R_HELD)) == offer
                elif cb.get(cb.reader(i, ipc.R_PREPARED)) == session:  # failed before reporting
                    reports[i] = False
            return len(reports) == self.num_readers

        self._poll(
            all_reported,
            deadline,
            lambda: (
                f"waiting for reader(s) {sorted(set(range(self.num_readers)) - set(reports))} "
                f"to report the base they hold (offered: version {offer})"
            ),
        )
        return sorted(i for i, held in reports.items() if not held)

    def _send_buckets(
        self,
        source: Source,
        version: int,
        session: int,
        base: int,
        deadline: Deadline,
        delta: bool = False,
    ) -> int:
        """Pack bucket k into slot k % 2 once its readers released it (its delta written over it
        when `delta` and that is smaller); publish its sequence number. The bytes moved."""
        cb = self._cb
        total = 0
        with torch.no_grad():
            for k in range(len(self.layout.buckets)):
                j = k % ipc.NUM_SLOTS
                previous = cb.get(cb.slot(j, ipc.S_SEQ))
                self._poll(
                    lambda previous=previous: self._slot_free(previous, session, base),  # type: ignore[misc]
                    deadline,
                    f"waiting for readers to release slot {j} (version {version})",
                )
                if self._failed(session):
                    break  # a reader gave up: stop, and abort the others in `_vote`
                data = self._encoded(k, j, self._pack(source, k, self._slots.tensors[j]), delta)
                if self.checksums:
                    cb.set(cb.slot(j, ipc.S_CRC), bucket_checksum(data))
                self._slots.sync()  # the bytes are in the slot before the sequence number says so
                cb.set(cb.slot(j, ipc.S_BUCKET), k)
                cb.set(cb.slot(j, ipc.S_NBYTES), data.numel())
                cb.set(cb.slot(j, ipc.S_SESSION), session)
                memory_fence()
                cb.set(cb.slot(j, ipc.S_SEQ), base + k + 1)
                total += data.numel()
        return total

    def _pack(self, source: Source, k: int, slot: torch.Tensor) -> torch.Tensor:
        """Bucket `k` written into `slot` (on the current stream of its device); its bytes there."""
        if not isinstance(source, StreamCursor):
            return pack_bucket(self.layout, k, source, slot)
        fill_bucket(source, k, slot)
        if k == len(self.layout.buckets) - 1:
            source.finish()  # nothing may follow the last tensor
        return slot[: self.layout.buckets[k].nbytes]

    def _encoded(self, k: int, j: int, data: torch.Tensor, delta: bool) -> torch.Tensor:
        """Bucket `k`, packed in slot `j`, as it travels: its delta written over it when that is
        smaller (the slot record says which, with the digest of the bucket's new bytes). On GPU
        slots the encoder reads a host copy of the bucket and the delta is copied back up."""
        if self.delta is None:
            return data
        payload = self.delta.encode(k, data, delta)
        if payload.kind != FULL:
            data = self._slots.tensors[j][: payload.nbytes]
            data.copy_(payload.data)
        self._cb.set(self._cb.slot(j, ipc.S_KIND), DELTA_KINDS.index(payload.kind))
        self._cb.set(self._cb.slot(j, ipc.S_DIGEST), digest_word(payload.digest))
        return data

    def _vote(self, version: int, session: int, deadline: Deadline) -> None:
        """Two-phase commit: commit only if every reader prepared; wait until all committed."""
        cb = self._cb
        failed = self._failed(session)
        if failed:
            cb.set(ipc.G_ABORT, session)  # the others stop waiting for buckets that will not come
        self._poll(lambda: self._all_prepared(session), deadline, f"waiting for readers to prepare {version}")
        failed = failed or self._failed(session)
        if failed:
            cb.set(ipc.G_ABORT, session)
            raise SyncAbortedError(
                f"version {version} aborted, nothing applied: reader(s) {failed} failed to take it"
            )
        memory_fence()
        cb.set(ipc.G_COMMIT, session)
        self._poll(
            lambda: all(cb.get(cb.reader(i, ipc.R_DONE)) == session for i in range(self.num_readers)),
            deadline,
            f"waiting for readers to commit {version}",
        )

    def _slot_free(self, previous: int, session: int, base: int) -> bool:
        """Every reader is done with the bucket the slot held (or that bucket is from an old session:
        `send` waited for readers of old sessions before writing any slot)."""
        if previous <= base:
            return True
        cb = self._cb
        return all(
            cb.get(cb.reader(i, ipc.R_ACK)) >= previous or cb.get(cb.reader(i, ipc.R_PREPARED)) == session
            for i in range(self.num_readers)
        )

    def _failed(self, session: int) -> list[int]:
        cb = self._cb
        return [
            i
            for i in range(self.num_readers)
            if cb.get(cb.reader(i, ipc.R_PREPARED)) == session
            and cb.get(cb.reader(i, ipc.R_RESULT)) == ipc.RESULT_FAILED
        ]

    def _all_prepared(self, session: int) -> bool:
        cb = self._cb
        return all(cb.get(cb.reader(i, ipc.R_PREPARED)) == session for i in range(self.num_readers))

    def close(self) -> None:
        """Tell readers the channel is gone; free the slots and the control block.

        The slots are freed only once no live reader maps them, since CUDA leaves freeing an
        exported region that another process still maps undefined: after `detach_timeout_s` the
        slots still mapped are kept, SlotsStillMappedError names the readers, and `free_slots`
        (or any later sender of this process, or `IpcChannelWriter`) frees them as soon as the
        last of those readers unmapped them or died.
        """
        if self._closed:
            self.free_slots()
            return
        self._closed = True
        cb = self._cb
        cb.set(ipc.G_CLOSED, 1)
        still = self._wait_detached(self.detach_timeout_s)
        if not still:
            self._free()
            return
        pids = {i: cb.get(cb.reader(i, ipc.R_PID)) for i in still}
        self._segment.unlink()  # no reader finds the channel now; its block stays mapped to watch them
        _RETIRED.add(self)
        raise SlotsStillMappedError(
            f"IPC channel {self.name}: reader(s) {still} (pids {list(pids.values())}) still map the "
            f"slots {self.detach_timeout_s:.1f}s after close; the slots ({ipc.NUM_SLOTS} x "
            f"{self.layout.max_bucket_nbytes} bytes) are kept, not freed under a reader, until no live "
            "reader maps them (free_slots(); close the readers first)",
            still,
        )

    def free_slots(self) -> bool:
        """Free the slots of this closed channel if no live reader maps them any more; True once
        they are freed. An open channel's slots are its own: False."""
        if self._freed:
            return True
        if not self._closed or any(self._cb.attached(i) for i in range(self.num_readers)):
            return False
        self._free()
        return True

    def _free(self) -> None:
        self._cb.detach()
        self._segment.close()
        self._segment.unlink()
        self._slots.close()
        self._freed = True
        _RETIRED.discard(self)

    def _wait_detached(self, seconds: float) -> list[int]:
        """Live readers that still have the slots open after waiting up to `seconds`."""
        cb = self._cb
        end = time.monotonic() + seconds
        backoff = Backoff(initial=1e-3, maximum=50e-3)
        while (left := [i for i in range(self.num_readers) if cb.attached(i)]) and time.monotonic() < end:
            backoff.sleep(end - time.monotonic())
        return left

    def __enter__(self) -> CudaIpcSender:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except SlotsStillMappedError as error:  # do not hide the error already on its way out
            _log.error("%s", error)


def _text(what: Callable[[], str] | str) -> str:
    return what if isinstance(what, str) else what()
