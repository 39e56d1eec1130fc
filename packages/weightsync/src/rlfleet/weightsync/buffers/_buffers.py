"""Weight buffers on the receiving side: where bucket bytes land and how a version becomes live.

Each buffer is a `BucketConsumer` over a receiver's live tensors (a ``name -> tensor`` dict,
e.g. ``module.state_dict(keep_vars=True)``), and keeps the seed's strategy names:

- `DirectBuffer` ("None"): no buffer kept between syncs. By default it stages the incoming
  version in scratch memory allocated for the sync and freed at commit, so a failed sync
  leaves version v intact; with ``max_staging_bytes`` below the model size it writes buckets
  straight into the live tensors (memory O(0)) and is *not* atomic: a failure mid-stream
  leaves a mix of v and v+1, reported by `torn`.
- `DoubleBuffer` ("Double"): a full staging copy allocated once and reused; the receiver keeps
  serving v while v+1 arrives, and commit flips to v+1 under an exclusive `serving` lock
  (``mode="copy"`` copies staging into the live tensors; ``mode="swap"`` swaps storages in
  O(number of tensors), and the old storages become the next staging area).
- `SharedBuffer` ("Shared", in `_shared_buffer`): one per node in shared memory.

Every error leaves the applied version in place: out-of-order versions raise VersionError at
`begin`, a commit with a missing bucket raises IncompleteSyncError, and a transport error ends
in `abort`, which drops what was received. ``prepare_commit(v, deadline)`` acquires what the
commit needs (the serving lock, a checked version number) before a receiver votes, so that a
commit after the vote cannot fail; `abort` releases it.

`DirectBuffer` and `DoubleBuffer` offer their pending storage as landing zones (`_landing.py`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Literal

import torch

from rlfleet.weightsync._deadline import DEFAULT_SERVING_TIMEOUT_S, DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import IncompleteSyncError, MetadataError, VersionError, WeightSyncError
from rlfleet.weightsync.buffers._landing import LandingMixin
from rlfleet.weightsync.buffers._serving import ServingLock, ServingMixin
from rlfleet.weightsync.layout._block import live_tensors
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._layout import DEFAULT_BUCKET_BYTES, Layout
from rlfleet.weightsync.layout._packing import bucket_starts, flat_views
from rlfleet.weightsync.protocol._core import check_version

__all__ = ["BufferBase", "DirectBuffer", "DoubleBuffer", "ServingLock"]

_log = logging.getLogger(__name__)

#: How long a commit waits for in-flight requests (in ``prepare_commit``, or in ``commit`` without it).
DEFAULT_COMMIT_TIMEOUT_S = DEFAULT_SERVING_TIMEOUT_S


class BufferBase:
    """Session bookkeeping shared by the buffers: versions, bucket accounting, prepare, abort.

    A subclass fills the hooks: `_begin`, `_stage` (take a bucket), `_prepare` (acquire what
    `_publish` needs; released by `_unprepare`), `_publish` (make the version visible; after a
    successful `_prepare` it must neither fail nor block without bound) and `_drop`.
    """

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._version = -1
        self._pending: int | None = None
        self._received: set[int] = set()
        self._state_lock = threading.RLock()
        self._starts = bucket_starts(layout)
        self._prepared: int | None = None  # the pending version `prepare_commit` readied
        self.last_error: BaseException | None = None

    # -- BucketConsumer -------------------------------------------------------------------
    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def version(self) -> int:
        """The applied (visible) version; -1 before the first commit."""
        return self._version

    @property
    def pending_version(self) -> int | None:
        return self._pending

    def begin(self, version: int) -> None:
        version = check_version(version)
        with self._state_lock:
            if self._pending is not None:
                _log.warning(
                    "%s: begin(%d) while version %d was pending; dropping it",
                    type(self).__name__,
                    version,
                    self._pending,
                )
                self._drop_pending()
            if version <= self._version:
                raise VersionError(f"version {version} is not newer than the applied version {self._version}")
            self._begin(version)
            self._pending = version
            self._received = set()

    def consume(self, index: int, data: torch.Tensor) -> None:
        with self._state_lock:
            if self._pending is None:
                raise WeightSyncError(f"bucket {index} arrived outside a sync (no begin, or after abort)")
            buckets = self._layout.buckets
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(buckets):
                raise MetadataError(f"bucket {index!r} does not exist (layout has {len(buckets)})")
            nbytes = buckets[index].nbytes
            if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != nbytes:
                raise MetadataError(
                    f"bucket {index} must be {nbytes} flat uint8 bytes, got {data.dtype} {tuple(data.shape)}"
                )
            if index in self._received:
                raise MetadataError(f"bucket {index} of version {self._pending} arrived twice")
            self._stage(index, data)
            self._received.add(index)

    def _check_complete(self, version: int) -> None:
        """VersionError unless `version` is pending; IncompleteSyncError if a needed bucket is missing."""
        if self._pending is None or version != self._pending:
            raise VersionError(f"commit of version {version}, but the pending version is {self._pending}")
        check_version(version)
        missing = [i for i in self._needed() if i not in self._received]
        if missing:
            first = self._layout.buckets[missing[0]]
            raise IncompleteSyncError(
                f"version {version} is missing {len(missing)} of {len(self._layout.buckets)} buckets "
                f"(first: bucket {first.index}, holding {first.tensors[0].name!r})"
            )

    def prepare_commit(
        self, version: int, deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S
    ) -> None:
        """Acquire everything `commit(version)` needs, so that it cannot fail afterwards.

        Called by a transport after every bucket arrived and before its rank votes; raises
        (VersionError, IncompleteSyncError, or the hook's error such as a serving-lock timeout)
        if the commit could not go through. `abort` releases what it acquired.
        """
        deadline = Deadline.coerce(deadline)
        with self._state_lock:
            self._check_complete(version)
            if self._prepared != version:
                self._prepare(version, deadline)
                self._prepared = version

    def commit(self, version: int) -> None:
        with self._state_lock:
            try:
                self._check_complete(version)
            except IncompleteSyncError as error:
                self.abort(error)
                raise
            try:
                self._publish(version)
            except BaseException as exc:
                self.abort(exc)
                raise
            self._version = version
            self._pending = None
            self._prepared = None
            self._received = set()

    def abort(self, error: BaseException) -> None:
        with self._state_lock:
            self.last_error = error
            if self._pending is not None:
                self._drop_pending()

    def _drop_pending(self) -> None:
        try:
            if self._prepared is not None:
                self._unprepare()
            self._drop()
        finally:
            self._pending = None
            self._prepared = None
            self._received = set()

    # -- strategy hooks -------------------------------------------------------------------
    def _needed(self) -> Iterable[int]:
        """The buckets a commit needs (every bucket of the layout)."""
        return range(len(self._layout.buckets))

    def _begin(self, version: int) -> None:  # pragma: no cover - trivial default
        pass

    def _stage(self, index: int, data: torch.Tensor) -> None:
        raise NotImplementedError

    def _prepare(self, version: int, deadline: Deadline) -> None:
        pass

    def _unprepare(self) -> None:
        pass

    def _publish(self, version: int) -> None:
        raise NotImplementedError

    def _drop(self) -> None:  # pragma: no cover - trivial default
        pass


def _checked_live(
    live: Mapping[str, torch.Tensor] | torch.nn.Module, layout: Layout | None, bucket_bytes: int
) -> tuple[dict[str, torch.Tensor], Layout]:
    tensors = live_tensors(live) if isinstance(live, torch.nn.Module) else dict(live)
    layout = layout if layout is not None else Layout.from_state_dict(tensors, bucket_bytes)
    layout.check_state_dict(tensors)
    return tensors, layout


def _storage_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors.values():
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class DirectBuffer(LandingMixin, ServingMixin, BufferBase):
    """Strategy "None": nothing kept between syncs.

    With ``max_staging_bytes=None`` (default) or a cap at least the layout's size, the version
    is staged in a scratch buffer allocated at `begin` and freed after `commit`: atomic, at the
    cost of a transient full copy. With a smaller cap it writes each bucket into the live
    tensors as it arrives: no extra memory, but serving during the sync sees a mix, and a
    failure mid-stream leaves the live tensors torn (`torn` is True, `version` unchanged)
    until the next complete sync. Choose "Double" or "Shared" when atomicity matters and
    memory is short.

    Landing: atomic, a transport writes each bucket straight into the staging buffer
    (`bucket_target`), so the only copy left is the one into the live tensors at commit. In
    place, large tensors land straight in the live tensors (`tensor_target`; `torn` is set as
    soon as one is handed out), and only runs of small tensors are copied out of the
    transport's bucket buffer. The staging is not kept between syncs: "nothing kept" is this
    strategy's contract (a staging area allocated once is `DoubleBuffer(mode="copy")`).
    """

    def __init__(
        self,
        live: Mapping[str, torch.Tensor] | torch.nn.Module,
        layout: Layout | None = None,
        *,
        max_staging_bytes: int | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        commit_timeout_s: float | None = DEFAULT_COMMIT_TIMEOUT_S,
    ) -> None:
        self.live, layout = _checked_live(live, layout, bucket_bytes)
        super().__init__(layout)
        self.max_staging_bytes = max_staging_bytes
        self.commit_timeout_s = commit_timeout_s
        self.serving_lock = ServingLock()
        self.torn = False
        self.peak_extra_bytes = 0
        self._staging: torch.Tensor | None = None
        self._landed = {}
        self._device = next(iter(self.live.values())).device if self.live else torch.device("cpu")

    @property
    def atomic(self) -> bool:
        return self.max_staging_bytes is None or self._layout.padded_bytes <= self.max_staging_bytes

    @property
    def extra_bytes(self) -> int:
        """Bytes held beyond the live tensors right now (0 between syncs)."""
        return 0 if self._staging is None else self._staging.numel()

    def _flat_pending(self) -> torch.Tensor | None:
        return self._staging

    def _tensor_home(self, name: str) -> torch.Tensor | None:
        # atomic: the whole bucket lands in staging (`bucket_target`); in place: the live tensor
        return None if self.atomic else self.live[name]

    def _on_land(self) -> None:
        self.torn = True  # the transport is about to write a live tensor

    def _begin(self, version: int) -> None:
        self._landed = {}
        if self.atomic:
            self._staging = torch.empty(self._layout.padded_bytes, dtype=torch.uint8, device=self._device)
            self.peak_extra_bytes = max(self.peak_extra_bytes, self._staging.numel())

    def _stage(self, index: int, data: torch.Tensor) -> None:
        if self._staging is None:
            self.torn = True
        self._land(index, data, self._staging, self.live)

    def _publish(self, version: int) -> None:
        staging = self._staging
        with self._committing():
            if staging is not None:
                views = flat_views(self._layout, staging)
                names = list(views)
                copy_pairs([self.live[n] for n in names], [views[n] for n in names])
        self._staging = None
        self._landed = {}
        self.torn = False

    def _drop(self) -> None:
        self._staging = None
        self._landed = {}
        if self.torn:
            _log.error(
                "DirectBuffer (in place, max_staging_bytes=%s): sync aborted mid-stream; live weights "
                "are torn between version %d and the aborted one until the next complete sync",
                self.max_staging_bytes,
                self._version,
            )


class DoubleBuffer(LandingMixin, ServingMixin, BufferBase):
    """Strategy "Double": a full staging copy, allocated once and reused for every version.

    The receiver keeps serving version v (under `serving()`) while v+1 lands in staging;
    `commit` checks every bucket arrived, then flips under the exclusive serving lock:

    - ``mode="copy"`` (default) copies staging into the live tensors. Works with any tensors
      that alias the model's (``state_dict(keep_vars=False)`` too); commit costs one memcpy.
    - ``mode="swap"`` sets each live tensor's ``.data`` to its staging tensor and keeps the old
      storage as the next staging area: commit costs O(number of tensors), no copy. The live
      dict must hold the objects the model computes with (`live_tensors(module)`); anything
      else that captured the old storage (a CUDA graph, a detached alias) keeps seeing v.

    Landing: in copy mode (live tensors on one device) the staging is one flat buffer laid out
    like the wire's buckets, and a transport writes each bucket straight into it
    (`bucket_target`); in swap mode the staging tensors are the previous live storages, and
    large contiguous ones take their tensor straight from the transport (`tensor_target`).
    """

    def __init__(
        self,
        live: Mapping[str, torch.Tensor] | torch.nn.Module,
        layout: Layout | None = None,
        *,
        mode: Literal["copy", "swap"] = "copy",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        commit_timeout_s: float | None = DEFAULT_COMMIT_TIMEOUT_S,
    ) -> None:
        if mode not in ("copy", "swap"):
            raise ValueError(f"DoubleBuffer mode must be 'copy' or 'swap', got {mode!r}")
        self.live, layout = _checked_live(live, layout, bucket_bytes)
        super().__init__(layout)
        self.mode = mode
        self.commit_timeout_s = commit_timeout_s
        self.serving_lock = ServingLock()
        self._landed = {}
        devices = {tensor.device for tensor in self.live.values()}
        #: copy mode: the staging as one flat buffer, bucket i at bucket_starts[i] (a landing zone)
        self._flat: torch.Tensor | None = None
        self.staging: dict[str, torch.Tensor]
        if mode == "copy" and len(devices) <= 1:
            device = next(iter(devices), torch.device("cpu"))
            self._flat = torch.empty(layout.padded_bytes, dtype=torch.uint8, device=device)
            self.staging = flat_views(layout, self._flat)
        else:  # swap: staging tensors become live ones, so they keep each live tensor's format
            with torch.no_grad():
                self.staging = {
                    name: torch.empty_like(tensor.detach(), memory_format=torch.preserve_format)
                    for name, tensor in self.live.items()
                }

    @property
    def extra_bytes(self) -> int:
        """Bytes of the staging copy (allocated once)."""
        return _storage_bytes(self.staging)

    def _flat_pending(self) -> torch.Tensor | None:
        return self._flat

    def _tensor_home(self, name: str) -> torch.Tensor | None:
        return self.staging.get(name)

    def _begin(self, version: int) -> None:
        self._landed = {}

    def _stage(self, index: int, data: torch.Tensor) -> None:
        self._land(index, data, self._flat, self.staging)

    def _drop(self) -> None:
        self._landed = {}

    def _publish(self, version: int) -> None:
        self._landed = {}
        with self._committing(), torch.no_grad():
            if self.mode == "copy":
                names = list(self.live)
                copy_pairs([self.live[n] for n in names], [self.staging[n] for n in names])
                return
            for name, tensor in self.live.items():
                previous = tensor.data
                tensor.data = self.staging[name]
                self.staging[name] = previous
