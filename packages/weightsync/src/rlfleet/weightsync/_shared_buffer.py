"""Strategy "Shared": one weight buffer per node, in shared memory, read in place by every receiver.

The segment holds two slots, each a flat all-buckets copy of the model (`pack_all` order), so
version v stays readable while v+1 is written. One node writer fills the free slot, either as a
`BucketConsumer` (fed by any transport: the node's receiver of a cross-node sync) or with
`publish(state_dict, version)` straight from a trainer on the node (one copy of the bytes
serves every local receiver). A trainer that `adopt`s its tensors keeps them in one flat block
laid out like a slot, and each `publish` is then a single streaming copy of that block.
Readers map the data read-only and bind their parameters to zero-copy views of the newest
committed slot, so per-node weight memory is two model copies whatever the number of receivers.

Safety: each reader records in the header which slot it is bound to (with its pid and start
time), and which slot it pins while it checks or copies one. The writer marks the slot it is
about to write, then waits, under a deadline, until no live reader is bound to it or pins it;
readers pick slots and writers claim them under an flock on the segment, which the kernel
releases if its holder dies. A dead reader's marker is ignored.

Integrity: with ``checksums=True`` the writer stores a CRC32 per bucket of each committed slot;
a reader verifies a slot before it binds to it (`refresh`) or copies it (`copy_version`), so a
byte corrupted in shared memory is refused (`ChecksumMismatchError`) and nothing is applied.
Readers also check the writer's layout digest when they attach (an error names the parameter).

Two kinds of reader: zero-copy readers (`refresh`, strategy "Shared") compute with views of
the slot; copying readers (`copy_version`) hand a version's buckets to their own
`BucketConsumer` (a private Direct/Double buffer fed from the node's one written copy).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from rlfleet.weightsync._block import adopt, flat_block
from rlfleet.weightsync._buffers import BufferBase, live_tensors
from rlfleet.weightsync._copy import copy_tensors
from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    LayoutMismatchError,
    MetadataError,
    PeerLostError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync._integrity import bucket_checksum
from rlfleet.weightsync._layout import Layout
from rlfleet.weightsync._packing import bucket_starts, flat_views
from rlfleet.weightsync._protocol import BucketConsumer
from rlfleet.weightsync._shm import PAGE, SharedSegment, page_align, process_alive, process_identity

__all__ = ["SharedBuffer", "SharedBufferReader"]

_log = logging.getLogger(__name__)

MAGIC = 0x524C46_53484152  # "RLF" "SHAR"
FORMAT = 2
SLOTS = 2
G_MAGIC, G_FORMAT, G_NUM_READERS, G_SLOT_BYTES = 0, 1, 2, 3
G_LAYOUT_LEN, G_LAYOUT_OFFSET, G_DATA_OFFSET, G_WRITER_PID = 4, 5, 6, 7
G_WRITER_START, G_CLOSED, G_CHECKSUMS, G_CRC_OFFSET, G_NUM_BUCKETS = 8, 9, 10, 11, 12
G_DIGEST = 16  # 4 words
SLOT_BASE, SLOT_WORDS = 24, 2
S_VERSION, S_STATE = 0, 1
EMPTY, WRITING, COMMITTED = 0, 1, 2
READER_BASE = SLOT_BASE + SLOT_WORDS * SLOTS
READER_WORDS = 5
R_PID, R_START, R_IN_USE, R_VERSION, R_PIN = 0, 1, 2, 3, 4
MAX_READERS = 4096
DEFAULT_TIMEOUT_S = 60.0


def _words(num_readers: int) -> int:
    return READER_BASE + READER_WORDS * num_readers


class _Header:
    def __init__(self, words: np.ndarray) -> None:
        self.h = words

    def get(self, word: int) -> int:
        return int(self.h[word])

    def set(self, word: int, value: int) -> None:
        self.h[word] = value

    @staticmethod
    def slot(j: int, field: int) -> int:
        return SLOT_BASE + SLOT_WORDS * j + field

    @staticmethod
    def reader(i: int, field: int) -> int:
        return READER_BASE + READER_WORDS * i + field

    def newest(self) -> int | None:
        """The committed slot with the highest version (None before the first commit)."""
        best: int | None = None
        for j in range(SLOTS):
            if self.get(self.slot(j, S_STATE)) == COMMITTED and (
                best is None or self.get(self.slot(j, S_VERSION)) > self.get(self.slot(best, S_VERSION))
            ):
                best = j
        return best

    def slot_holding(self, version: int) -> int | None:
        """The committed slot whose version is exactly `version`, if any."""
        for j in range(SLOTS):
            if self.get(self.slot(j, S_STATE)) == COMMITTED and self.get(self.slot(j, S_VERSION)) == version:
                return j
        return None

    def reader_alive(self, i: int) -> bool:
        return process_alive(self.get(self.reader(i, R_PID)), self.get(self.reader(i, R_START)))


def _crc_table_bytes(num_buckets: int) -> int:
    return 8 * SLOTS * num_buckets


def _require_writer_layout(mine: Layout, writer: Layout, what: str) -> None:
    """LayoutMismatchError naming the first differing parameter, unless the digests agree."""
    if mine.digest != writer.digest:
        problem = mine.diff(writer) or "digests differ"
        param = problem.split("'")[1] if "'" in problem else None
        raise LayoutMismatchError(f"{what} layout vs writer: {problem}", param)


class SharedBuffer(BufferBase):
    """The node writer of a shared weight buffer (a `BucketConsumer`).

    ``SharedBuffer(layout, num_readers)`` creates the segment; hand `name` to the receivers on
    the node (`SharedBufferReader.attach`). `begin` waits, at most ``timeout_s``, for readers
    still bound to the slot it needs to refresh onto the newer one. ``checksums=True`` stores
    a CRC32 per bucket of every committed version, which readers verify before using it.
    """

    def __init__(
        self,
        layout: Layout,
        num_readers: int,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        prefix: str = "rlfleet",
        checksums: bool = False,
    ) -> None:
        if (
            isinstance(num_readers, bool)
            or not isinstance(num_readers, int)
            or not 1 <= num_readers <= MAX_READERS
        ):
            raise ValueError(f"num_readers must be an int in [1, {MAX_READERS}], got {num_readers!r}")
        super().__init__(layout)
        self.num_readers = num_readers
        self.timeout_s = timeout_s
        self.checksums = bool(checksums)
        layout_json = layout.to_json()
        words = _words(num_readers)
        layout_offset = (words * 8 + 63) // 64 * 64
        num_buckets = len(layout.buckets)
        crc_offset = (layout_offset + len(layout_json) + 63) // 64 * 64
        data_offset = page_align(crc_offset + _crc_table_bytes(num_buckets))
        self.slot_bytes = max(PAGE, page_align(layout.padded_bytes))
        self._segment = SharedSegment.create(data_offset + SLOTS * self.slot_bytes, prefix=prefix)
        buf = self._segment.buffer
        header = _Header(np.frombuffer(buf, dtype=np.int64, count=words))
        self._header = header
        buf[layout_offset : layout_offset + len(layout_json)] = layout_json
        header.h[G_DIGEST : G_DIGEST + 4] = np.frombuffer(bytes.fromhex(layout.digest), dtype=np.int64)
        pid, start = process_identity()
        for word, value in (
            (G_FORMAT, FORMAT),
            (G_NUM_READERS, num_readers),
            (G_SLOT_BYTES, self.slot_bytes),
            (G_LAYOUT_LEN, len(layout_json)),
            (G_LAYOUT_OFFSET, layout_offset),
            (G_DATA_OFFSET, data_offset),
            (G_WRITER_PID, pid),
            (G_WRITER_START, start),
            (G_CHECKSUMS, int(self.checksums)),
            (G_CRC_OFFSET, crc_offset),
            (G_NUM_BUCKETS, num_buckets),
        ):
            header.set(word, value)
        self._crcs = np.frombuffer(buf, dtype=np.int64, count=SLOTS * num_buckets, offset=crc_offset).reshape(
            SLOTS, num_buckets
        )
        for i in range(num_readers):
            header.set(header.reader(i, R_IN_USE), -1)
            header.set(header.reader(i, R_PIN), -1)
        header.set(G_MAGIC, MAGIC)
        self._slots = [
            self._segment.tensor(data_offset + j * self.slot_bytes, self.slot_bytes) for j in range(SLOTS)
        ]
        self._writing: int | None = None
        self._begin_deadline: Deadline | None = None
        self._views: dict[int, list[torch.Tensor]] = {}

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def extra_bytes(self) -> int:
        """Bytes of the node's segment (two model copies, whatever the number of readers)."""
        return self._segment.size

    def _deadline(self) -> Deadline:
        return Deadline(self.timeout_s)

    # -- BucketConsumer hooks -------------------------------------------------------------
    def _begin(self, version: int) -> None:
        self._claim_slot(self._begin_deadline or self._deadline())

    def _claim_slot(self, deadline: Deadline) -> None:
        header = self._header
        with self._segment.locked(deadline, "claiming a slot"):
            newest = header.newest()
            target = 0 if newest is None else 1 - newest
            # the older slot is still read but nobody took the newest (it was refused, or
            # skipped): overwrite the newest rather than wait; readers go from older to ours
            if newest is not None and self._reader_on(target) is not None and self._reader_on(newest) is None:
                target = newest
            previous_state = header.get(header.slot(target, S_STATE))
            header.set(header.slot(target, S_STATE), WRITING)
        backoff = Backoff()
        try:
            while (holder := self._reader_on(target)) is not None:
                if deadline.expired:
                    pid = header.get(header.reader(holder, R_PID))
                    raise deadline.error(
                        f"shared buffer {self.name}: reader {holder} (pid {pid}) still reads slot {target} "
                        f"(version {header.get(header.slot(target, S_VERSION))}); it must refresh()"
                    )
                backoff.sleep(deadline.remaining())
        except BaseException:
            with self._segment.locked(Deadline(None), "releasing a slot"):
                header.set(header.slot(target, S_STATE), previous_state)
            raise
        self._writing = target

    def _reader_on(self, slot: int) -> int | None:
        """A live reader bound to `slot`, or pinning it to check or copy it."""
        header = self._header
        for i in range(self.num_readers):
            uses = (header.get(header.reader(i, R_IN_USE)), header.get(header.reader(i, R_PIN)))
            if slot in uses and header.reader_alive(i):
                return i
        return None

    def _slot_region(self, index: int) -> torch.Tensor:
        assert self._writing is not None
        start = self._starts[index]
        return self._slots[self._writing][start : start + self._layout.buckets[index].nbytes]

    def _stage(self, index: int, data: torch.Tensor) -> None:
        self._slot_region(index).copy_(data)

    def _publish(self, version: int) -> None:
        header, target = self._header, self._writing
        assert target is not None
        if self.checksums:  # of the bytes as they lie in the slot: what readers will check
            slot = self._slots[target]
            for bucket, start in zip(self._layout.buckets, self._starts, strict=True):
                self._crcs[target, bucket.index] = bucket_checksum(slot[start : start + bucket.nbytes])
        with self._segment.locked(self._deadline(), "publishing a version"):
            header.set(header.slot(target, S_VERSION), version)
            header.set(header.slot(target, S_STATE), COMMITTED)
        self._writing = None

    def _drop(self) -> None:
        if self._writing is not None:
            with self._segment.locked(Deadline(None), "dropping a version"):
                self._header.set(self._header.slot(self._writing, S_STATE), EMPTY)
            self._writing = None

    # -- direct path ------------------------------------------------------------------------
    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        deadline: Deadline | float | None = None,
        threads: int | None = None,
    ) -> None:
        """Pack `state_dict` straight into the free slot and commit it as `version` (one copy).

        The copy is shared among `threads` threads (default: this process's CPUs, at most 8).
        """
        deadline = Deadline.coerce(deadline) if deadline is not None else self._deadline()
        self._layout.check_state_dict(state_dict)
        self._begin_deadline = deadline
        try:
            self.begin(version)
        finally:
            self._begin_deadline = None
        try:
            with self._state_lock:
                assert self._writing is not None
                block = flat_block(self._layout, state_dict)
                if block is not None and block.device.type == "cpu":  # one streaming block copy
                    slot = self._slots[self._writing]
                    copy_tensors([slot[: block.numel()]], [block], threads)
                else:
                    targets = self._slot_views(self._writing)
                    sources = [state_dict[name].detach() for name in self._layout.names]
                    copy_tensors(targets, sources, threads)
                self._received.update(range(len(self._layout.buckets)))
            self.commit(version)
        except BaseException as exc:
            self.abort(exc)
            raise

    def adopt(self, targets: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
        """Move the writer's tensors into one block laid out like a slot (`weightsync.adopt`); a
        `publish` of them is then one contiguous copy instead of one per tensor.

        Values, Parameter objects and the optimizers that hold them are kept; pass a module or a
        ``state_dict(keep_vars=True)``. CPU tensors only. A later `publish` whose tensors are no
        longer all in the block takes the per-tensor path, with the same result.
        """
        live = live_tensors(targets) if isinstance(targets, torch.nn.Module) else targets
        on_other = sorted({t.device.type for t in live.values()} - {"cpu"})
        if on_other:
            raise ValueError(f"SharedBuffer.adopt: CPU tensors only, got tensors on {on_other}")
        adopt(live, self._layout)

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        """Typed views of every tensor inside a slot, in layout order (built once per slot)."""
        views = self._views.get(slot)
        if views is None:
            views = list(flat_views(self._layout, self._slots[slot]).values())
            self._views[slot] = views
        return views

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Tell readers the writer is gone and unlink the segment (bound readers keep their views)."""
        if self._segment.closed:
            return
        self._header.set(G_CLOSED, 1)
        self._slots = []
        self._views = {}
        self._header = _Header(np.zeros(_words(self.num_readers), dtype=np.int64))
        self._crcs = np.zeros((SLOTS, len(self._layout.buckets)), dtype=np.int64)
        self._segment.close()
        self._segment.unlink()

    def __enter__(self) -> SharedBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SharedBufferReader:
    """A receiver on the node: binds its tensors to read-only views of the newest version.

    Writes through the bound tensors fault (the mapping is read-only), so receivers cannot
    corrupt each other's weights. Call `refresh()` when idle (between requests) to move to the
    newest committed version; the writer waits for readers to leave the older slot. A reader
    that keeps private weights instead takes each version with `copy_version`.
    """

    def __init__(
        self,
        segment: SharedSegment,
        header: _Header,
        reader_index: int,
        layout: Layout,
        slots: list[torch.Tensor],
        crcs: np.ndarray | None = None,
    ) -> None:
        self._segment = segment
        self._header = header
        self.reader_index = reader_index
        self.layout = layout
        self._slots = slots
        self._crcs = crcs  # per slot, per bucket CRC32 when the writer stores them
        self._verified: set[tuple[int, int]] = set()  # (slot, version) found intact
        self._starts = bucket_starts(layout)
        self._views: dict[int, dict[str, torch.Tensor]] = {}
        self._slot: int | None = None
        self._version = -1
        self._bound: list[dict[str, torch.Tensor]] = []

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def version(self) -> int:
        """The version this reader is bound to; -1 before the first `refresh`."""
        return self._version

    @classmethod
    def attach(
        cls,
        name: str,
        reader_index: int | None = None,
        *,
        expected_layout: Layout | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> SharedBufferReader:
        """Join shared buffer `name` as `reader_index` (or the first free index)."""
        deadline = Deadline(timeout_s)
        segment = SharedSegment.attach(name, map_whole=False)
        try:
            probe = np.frombuffer(segment.map_region(0, PAGE), dtype=np.int64, count=SLOT_BASE).copy()
            if probe[G_MAGIC] != MAGIC or probe[G_FORMAT] != FORMAT:
                raise MetadataError(f"{name!r} is not an rlfleet shared buffer of format {FORMAT}")
            num_readers, slot_bytes = int(probe[G_NUM_READERS]), int(probe[G_SLOT_BYTES])
            data_offset, layout_offset = int(probe[G_DATA_OFFSET]), int(probe[G_LAYOUT_OFFSET])
            layout_len = int(probe[G_LAYOUT_LEN])
            crc_offset, num_buckets = int(probe[G_CRC_OFFSET]), int(probe[G_NUM_BUCKETS])
            if (
                not 1 <= num_readers <= MAX_READERS
                or data_offset % PAGE
                or data_offset + SLOTS * slot_bytes != segment.size
                or not 0 < layout_offset < layout_offset + layout_len <= crc_offset
                or num_buckets < 0
                or crc_offset % 8
                or crc_offset + _crc_table_bytes(num_buckets) > data_offset
            ):
                raise MetadataError(f"shared buffer {name!r} has an inconsistent header")
            control = segment.map_region(0, data_offset)
            header = _Header(np.frombuffer(control, dtype=np.int64, count=_words(num_readers)))
            layout = Layout.from_json(bytes(control[layout_offset : layout_offset + layout_len]))
            if layout.padded_bytes > slot_bytes or len(layout.buckets) != num_buckets:
                raise MetadataError(f"shared buffer {name!r}: layout does not fit its slots")
            crcs = None
            if probe[G_CHECKSUMS]:
                crcs = np.frombuffer(
                    control, dtype=np.int64, count=SLOTS * num_buckets, offset=crc_offset
                ).reshape(SLOTS, num_buckets)
            if expected_layout is not None:
                _require_writer_layout(expected_layout, layout, f"shared buffer {name!r}: receiver")
            data = segment.map_region(data_offset, SLOTS * slot_bytes, readonly=True)
            slots = [segment.tensor(j * slot_bytes, slot_bytes, region=data) for j in range(SLOTS)]
            me, my_start = process_identity()
            with segment.locked(deadline, "claiming a reader index"):
                index = cls._claim_index(header, num_readers, reader_index, name)
                header.set(header.reader(index, R_IN_USE), -1)
                header.set(header.reader(index, R_PIN), -1)
                header.set(header.reader(index, R_VERSION), -1)
                header.set(header.reader(index, R_START), my_start)
                header.set(header.reader(index, R_PID), me)
            return cls(segment, header, index, layout, slots, crcs)
        except BaseException:
            segment.close()
            raise

    @staticmethod
    def _claim_index(header: _Header, num_readers: int, wanted: int | None, name: str) -> int:
        candidates = range(num_readers) if wanted is None else [wanted]
        if wanted is not None and (
            isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted < num_readers
        ):
            raise ValueError(
                f"reader_index {wanted!r} out of range: shared buffer {name!r} has {num_readers}"
            )
        for i in candidates:
            pid = header.get(header.reader(i, R_PID))
            if pid == 0 or not header.reader_alive(i):
                return i
        if wanted is not None:
            pid = header.get(header.reader(wanted, R_PID))
            raise WeightSyncError(f"shared buffer {name!r}: reader index {wanted} is held by live pid {pid}")
        raise WeightSyncError(f"shared buffer {name!r}: all {num_readers} reader indices are taken")

    # -- versions -------------------------------------------------------------------------
    def latest_version(self) -> int:
        """Newest committed version in the segment (-1 if none), without binding to it."""
        newest = self._header.newest()
        return -1 if newest is None else self._header.get(self._header.slot(newest, S_VERSION))

    @property
    def checksums(self) -> bool:
        """True when the writer stores per-bucket CRC32s (and this reader verifies them)."""
        return self._crcs is not None

    def _bucket(self, slot: int, index: int) -> torch.Tensor:
        start = self._starts[index]
        return self._slots[slot][start : start + self.layout.buckets[index].nbytes]

    def _verify_bucket(self, slot: int, index: int, version: int) -> torch.Tensor:
        """Bucket `index` of `slot`, checked against the writer's CRC32 when it stored one."""
        data = self._bucket(slot, index)
        if self._crcs is not None:
            expected = int(self._crcs[slot, index])
            got = bucket_checksum(data)
            if got != expected:
                raise ChecksumMismatchError(
                    f"shared buffer {self.name}: bucket {index} of version {version} fails its checksum "
                    f"(crc32 {got:#010x}, writer stored {expected:#010x}): corrupted in shared memory; "
                    "nothing applied"
                )
        return data

    def _verify_slot(self, slot: int, version: int) -> None:
        """Every bucket of `slot` (holding `version`) against its CRC32, once per (slot, version)."""
        if self._crcs is None or (slot, version) in self._verified:
            return
        for index in range(len(self.layout.buckets)):
            self._verify_bucket(slot, index, version)
        self._verified = {(j, v) for j, v in self._verified if j != slot}
        self._verified.add((slot, version))

    def check_version(self, version: int, deadline: Deadline | float | None = None) -> int:
        """Wait until `version` is committed and, with checksums on, verify it, without binding.

        A zero-copy reader that must not switch yet (it is serving) learns now, not at its
        swap, that the version is corrupted (ChecksumMismatchError) or gone (VersionError);
        the swap's `refresh` does not verify the same version again.
        """
        deadline = Deadline.coerce(deadline if deadline is not None else DEFAULT_TIMEOUT_S)
        slot = self._pin_version(version, deadline)
        try:
            self._verify_slot(slot, version)
        finally:
            self._pin(-1)
        return version

    def _pin(self, slot: int) -> None:
        self._header.set(self._header.reader(self.reader_index, R_PIN), slot)

    def _pin_version(self, version: int, deadline: Deadline) -> int:
        """Wait until `version` is committed, then pin its slot (the caller unpins); its slot."""
        self._wait_committed(version, deadline)
        with self._segment.locked(deadline, f"pinning version {version}"):
            slot = self._header.slot_holding(version)
            if slot is None:
                raise VersionError(
                    f"shared buffer {self.name}: version {version} is no longer there "
                    f"(the writer moved on to {self.latest_version()})"
                )
            self._pin(slot)
        return slot

    def refresh(self, deadline: Deadline | float | None = None) -> int:
        """Bind to the newest committed version (no-op if already there); returns the bound version.

        With checksums on, the new version is verified first; a corrupted one raises
        ChecksumMismatchError and the reader stays on the version it had.
        """
        deadline = Deadline.coerce(deadline if deadline is not None else DEFAULT_TIMEOUT_S)
        header, me = self._header, self.reader_index
        if header.get(G_CLOSED) and self._slot is not None:
            return self._version
        with self._segment.locked(deadline, "binding to the newest version"):
            newest = header.newest()
            if newest is None:
                return self._version
            version = header.get(header.slot(newest, S_VERSION))
            if newest == self._slot and version == self._version:
                return version
            self._pin(newest)  # the writer leaves it alone while we check it
        try:
            self._verify_slot(newest, version)
            with self._segment.locked(deadline, "binding to the newest version"):
                header.set(header.reader(me, R_IN_USE), newest)
                header.set(header.reader(me, R_VERSION), version)
        finally:
            self._pin(-1)
        self._slot, self._version = newest, version
        self._rebind()
        return version

    def _wait_committed(self, minimum: int, deadline: Deadline) -> None:
        def ready() -> bool:
            return self.latest_version() >= minimum

        def writer_alive() -> None:
            header = self._header
            if not process_alive(header.get(G_WRITER_PID), header.get(G_WRITER_START)) or header.get(
                G_CLOSED
            ):
                raise PeerLostError(f"shared buffer {self.name}: writer is gone before version {minimum}")

        deadline.poll(ready, f"shared buffer {self.name}: version {minimum}", on_wait=writer_alive)

    def wait_for_version(self, minimum: int, deadline: Deadline | float | None = None) -> int:
        """Poll until a version >= `minimum` is committed, then bind to it."""
        deadline = Deadline.coerce(deadline if deadline is not None else DEFAULT_TIMEOUT_S)
        self._wait_committed(minimum, deadline)
        return self.refresh(deadline)

    def copy_version(
        self, version: int, consumer: BucketConsumer, deadline: Deadline | float | None = None
    ) -> int:
        """Hand version `version` to `consumer` (begin, every bucket, commit) once it is committed.

        For a reader that keeps private weights (a Direct or Double buffer) but shares the
        node's one written copy. The slot is pinned while it is read; with checksums on, each
        bucket is verified before the consumer sees it. Any failure aborts the consumer, which
        keeps its previous version. VersionError if the writer already replaced `version`.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise VersionError(f"version must be an int, got {version!r}")
        deadline = Deadline.coerce(deadline if deadline is not None else DEFAULT_TIMEOUT_S)
        _require_writer_layout(consumer.layout, self.layout, f"shared buffer {self.name!r}: consumer")
        slot = self._pin_version(version, deadline)
        began = False
        try:
            consumer.begin(version)
            began = True
            for index in range(len(self.layout.buckets)):
                consumer.consume(index, self._verify_bucket(slot, index, version))
            consumer.commit(version)
        except BaseException as exc:
            if began:
                consumer.abort(exc)
            raise
        finally:
            self._pin(-1)
        return version

    # -- views and binding ----------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        """Zero-copy read-only views of the bound version, by name (empty before `refresh`)."""
        if self._slot is None:
            return {}
        views = self._views.get(self._slot)
        if views is None:
            views = flat_views(self.layout, self._slots[self._slot])
            self._views[self._slot] = views
        return views

    def bind(self, targets: Mapping[str, torch.Tensor]) -> None:
        """Point each target tensor's ``.data`` at the bound version's view (now and after refresh)."""
        self.layout.check_state_dict(targets)
        self._bound.append(dict(targets))
        self._rebind()

    def bind_module(self, module: torch.nn.Module) -> None:
        """Make `module` compute with the shared weights: its parameters and buffers become views.

        The module's own weight storage is released (if nothing else holds it). Do not write to
        the parameters: the mapping is read-only, a write faults.
        """
        self.bind(module.state_dict(keep_vars=True))

    def _rebind(self) -> None:
        if self._slot is None or not self._bound:
            return
        views = self.tensors()
        with torch.no_grad():
            for targets in self._bound:
                for name, tensor in targets.items():
                    tensor.data = views[name]

    def data_range(self) -> tuple[int, int]:
        """[start, end) addresses of this reader's mapping of the slots (to verify zero-copy)."""
        first, last = self._slots[0], self._slots[-1]
        return first.data_ptr(), last.data_ptr() + last.numel()

    # -- teardown -------------------------------------------------------------------------
    def close(self) -> None:
        """Leave the buffer: the writer may then overwrite the slot bound tensors still view."""
        if self._segment.closed:
            return
        header, me = self._header, self.reader_index
        header.set(header.reader(me, R_IN_USE), -1)
        header.set(header.reader(me, R_PIN), -1)
        header.set(header.reader(me, R_PID), 0)
        self._bound = []
        self._views = {}
        self._slots = []
        self._segment.close()

    def __enter__(self) -> SharedBufferReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
