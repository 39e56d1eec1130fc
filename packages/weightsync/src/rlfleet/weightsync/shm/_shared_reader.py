"""The receivers' side of a shared weight buffer (strategy "Shared"): bind or copy a version.

Two kinds of reader: zero-copy readers (`refresh`, strategy "Shared") compute with read-only
views of the newest committed slot; copying readers (`copy_version`) hand a version's buckets
to their own `BucketConsumer` (a private Direct/Double buffer fed from the node's one written
copy). Each reader records in the control block which slot it is bound to (with its pid and
start time) and which slot it pins while it checks or copies one, under the segment's flock,
so the writer never overwrites either; a dead reader's marks are ignored.

Integrity: when the writer stores CRC32s, a reader verifies a slot before it binds to it or
copies it (`ChecksumMismatchError`, nothing applied). A reader checks the writer's layout
digest when it attaches (an error names the parameter).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from rlfleet.weightsync._deadline import Deadline, deadline_or
from rlfleet.weightsync._errors import (
    ChecksumMismatchError,
    MetadataError,
    PeerLostError,
    VersionError,
    WeightSyncError,
)
from rlfleet.weightsync.layout._integrity import bucket_checksum
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_starts, flat_views
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.shm._shared_format import (
    DEFAULT_TIMEOUT_S,
    G_CHECKSUMS,
    G_CLOSED,
    R_IN_USE,
    R_PID,
    R_PIN,
    R_REFUSED,
    R_VERSION,
    SlotTable,
    require_writer_layout,
)
from rlfleet.weightsync.shm._shm import SharedSegment

__all__ = ["SharedBufferReader"]


class SharedBufferReader:
    """A receiver on the node: binds its tensors to read-only views of the newest version.

    Writes through the bound tensors fault (the mapping is read-only), so receivers cannot
    corrupt each other's weights. Call `refresh()` when idle (between requests) to move to the
    newest committed version; the writer waits for readers to leave the older slot. A reader
    that keeps private weights instead takes each version with `copy_version`, into a buffer
    built with the writer's layout: `layout` is the writer's, read from the segment (another
    process needs nothing else to build its `DoubleBuffer(model, layout=reader.layout)`). Every
    blocking call takes a deadline (a `Deadline` or seconds; None: 60 s).
    """

    def __init__(
        self,
        segment: SharedSegment,
        table: SlotTable,
        reader_index: int,
        layout: Layout,
        slots: list[torch.Tensor],
        crcs: np.ndarray | None = None,
    ) -> None:
        self._segment = segment
        self._table = table
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
        """Join shared buffer `name` as `reader_index` (or the first free index).

        The segment must be this user's, mode 0600 (`UnsafeSegmentError`), and a shared buffer
        whose layout matches `expected_layout` when one is given (`LayoutMismatchError`).
        """
        deadline = deadline_or(timeout_s, DEFAULT_TIMEOUT_S)
        segment = SharedSegment.attach(name, map_whole=False)
        try:
            table, plan, control = SlotTable.of(segment)
            start = plan.layout_offset
            layout = Layout.from_json(bytes(control[start : start + plan.layout_len]))
            if layout.padded_bytes > plan.slot_bytes or len(layout.buckets) != plan.num_buckets:
                raise MetadataError(f"shared buffer {name!r}: layout does not fit its slots")
            crcs = None
            if table.get(G_CHECKSUMS):
                count = plan.num_slots * plan.num_buckets
                crcs = np.frombuffer(control, dtype=np.int64, count=count, offset=plan.crc_offset)
                crcs = crcs.reshape(plan.num_slots, plan.num_buckets)
            if expected_layout is not None:
                require_writer_layout(expected_layout, layout, f"shared buffer {name!r}: receiver")
            data = segment.map_region(plan.data_offset, plan.num_slots * plan.slot_bytes, readonly=True)
            size = plan.slot_bytes
            slots = [segment.tensor(j * size, size, region=data) for j in range(plan.num_slots)]
            with segment.locked(deadline, "claiming a reader index"):
                index = cls._claim_index(table, reader_index, name)
                for field in (R_IN_USE, R_PIN, R_VERSION, R_REFUSED):
                    table.set(table.reader(index, field), -1)
                table.claim_reader(index)
            return cls(segment, table, index, layout, slots, crcs)
        except BaseException:
            segment.close()
            raise

    @staticmethod
    def _claim_index(table: SlotTable, wanted: int | None, name: str) -> int:
        num_readers = table.num_readers
        if wanted is not None and (
            isinstance(wanted, bool) or not isinstance(wanted, int) or not 0 <= wanted < num_readers
        ):
            raise ValueError(f"reader_index {wanted!r} out of range: {name!r} has {num_readers} readers")
        for i in range(num_readers) if wanted is None else [wanted]:
            if table.get(table.reader(i, R_PID)) == 0 or not table.reader_alive(i):
                return i
        if wanted is not None:
            pid = table.get(table.reader(wanted, R_PID))
            raise WeightSyncError(f"shared buffer {name!r}: reader index {wanted} is held by live pid {pid}")
        raise WeightSyncError(f"shared buffer {name!r}: all {num_readers} reader indices are taken")

    # -- versions -------------------------------------------------------------------------
    def latest_version(self) -> int:
        """Newest committed version in the segment (-1 if none), without binding to it."""
        return self._table.newest_version()

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
                # the writer may reuse this slot although it holds the newest version
                self._table.set(self._table.reader(self.reader_index, R_REFUSED), version)
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
        deadline = deadline_or(deadline, DEFAULT_TIMEOUT_S)
        slot = self._pin_version(version, deadline)
        try:
            self._verify_slot(slot, version)
        finally:
            self._pin(-1)
        return version

    def _pin(self, slot: int) -> None:
        self._table.set(self._table.reader(self.reader_index, R_PIN), slot)

    def _pin_version(self, version: int, deadline: Deadline) -> int:
        """Wait until `version` is committed, then pin its slot (the caller unpins); its slot."""
        self._wait_committed(version, deadline)
        with self._segment.locked(deadline, f"pinning version {version}"):
            slot = self._table.slot_holding(version)
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
        deadline = deadline_or(deadline, DEFAULT_TIMEOUT_S)
        table, me = self._table, self.reader_index
        if table.get(G_CLOSED) and self._slot is not None:
            return self._version
        with self._segment.locked(deadline, "binding to the newest version"):
            newest = table.newest()
            if newest is None:
                return self._version
            version = table.version(newest)
            if newest == self._slot and version == self._version:
                return version
            self._pin(newest)  # the writer leaves it alone while we check it
        try:
            self._verify_slot(newest, version)
            with self._segment.locked(deadline, "binding to the newest version"):
                table.set(table.reader(me, R_IN_USE), newest)
                table.set(table.reader(me, R_VERSION), version)
        finally:
            self._pin(-1)
        self._slot, self._version = newest, version
        self._rebind()
        return version

    def _wait_committed(self, minimum: int, deadline: Deadline) -> None:
        def ready() -> bool:
            return self.latest_version() >= minimum

        def writer_alive() -> None:
            if not self._table.writer_alive() or self._table.get(G_CLOSED):
                raise PeerLostError(f"shared buffer {self.name}: writer is gone before version {minimum}")

        deadline.poll(ready, f"shared buffer {self.name}: version {minimum}", on_wait=writer_alive)

    def wait_for_version(self, minimum: int, deadline: Deadline | float | None = None) -> int:
        """Poll until a version >= `minimum` is committed, then bind to it."""
        deadline = deadline_or(deadline, DEFAULT_TIMEOUT_S)
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
        deadline = deadline_or(deadline, DEFAULT_TIMEOUT_S)
        require_writer_layout(consumer.layout, self.layout, f"shared buffer {self.name!r}: consumer")
        slot = self._pin_version(version, deadline)
        began = False
        try:
            consumer.begin(version)
            began = True
            for index in range(len(self.layout.buckets)):
                consumer.consume(index, self._verify_bucket(slot, index, version))
            prepare = getattr(consumer, "prepare_commit", None)
            if prepare is not None:
                prepare(version, deadline)
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
        table, me = self._table, self.reader_index
        table.set(table.reader(me, R_IN_USE), -1)
        table.set(table.reader(me, R_PIN), -1)
        table.set(table.reader(me, R_PID), 0)
        table.detach()
        self._bound = []
        self._views = {}
        self._slots = []
        self._segment.close()

    def __enter__(self) -> SharedBufferReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
