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
in `abort`, which drops what was received.

`DirectBuffer` and `DoubleBuffer` offer their pending storage as landing zones (the wire's
`BucketTarget` / `TensorTarget`), so a broadcast writes received bytes straight into place
instead of into a bucket buffer that `consume` copies again: a whole bucket into a flat
staging buffer (atomic "None", "Double" copy mode), one large tensor into its staging tensor
("Double" swap mode) or, for the non-atomic in-place "None", into the live tensor itself. The
targets exist only while a version is pending (between `begin` and `commit`/`abort`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import Literal

import torch

from rlfleet.weightsync._copy import copy_tensors
from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import IncompleteSyncError, MetadataError, VersionError, WeightSyncError
from rlfleet.weightsync._layout import DEFAULT_BUCKET_BYTES, Layout
from rlfleet.weightsync._packing import _copy_all, bucket_starts, bucket_views, flat_views

__all__ = ["BufferBase", "DirectBuffer", "DoubleBuffer", "ServingLock", "live_tensors"]

_log = logging.getLogger(__name__)

DEFAULT_COMMIT_TIMEOUT_S = 60.0


def live_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a module actually computes with (parameters and persistent buffers), by name.

    ``state_dict(keep_vars=True)``: the Parameter / buffer objects themselves, so in-place
    copies and ``.data`` swaps reach the module (``keep_vars=False`` returns detached aliases,
    whose ``.data`` can be swapped without the module noticing).
    """
    return dict(module.state_dict(keep_vars=True))


class ServingLock:
    """Many servers at once, or one committer: a writer-preferring readers/writer lock.

    The serving path wraps each forward pass in `shared()`; a commit takes `exclusive()`, so a
    request sees all of v or all of v+1. Do not nest `shared()` in one thread while a commit
    may be waiting (writer preference would make the inner call wait for the commit).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def shared(self, deadline: Deadline | float | None = None) -> Iterator[None]:
        deadline = Deadline.coerce(deadline)
        with self._cond:
            deadline.wait(
                self._cond,
                "waiting for a weight commit to finish",
                lambda: not (self._writer or self._waiting_writers),
            )
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, deadline: Deadline | float | None = None) -> Iterator[None]:
        deadline = Deadline.coerce(deadline)
        with self._cond:
            self._waiting_writers += 1
            try:
                deadline.wait(
                    self._cond,
                    "waiting for in-flight requests before a weight commit",
                    lambda: not (self._writer or self._readers),
                )
            finally:
                self._waiting_writers -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


class BufferBase:
    """Session bookkeeping shared by the buffers: versions, bucket accounting, abort."""

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
        if isinstance(version, bool) or not isinstance(version, int):
            raise VersionError(f"version must be an int, got {version!r}")
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

    def prepare_commit(self, version: int, deadline: Deadline) -> None:
        """Acquire everything `commit(version)` needs, so that commit cannot fail afterwards.

        Called after every bucket arrived and was verified, before the receiver votes in a
        two-phase commit; raises (the receiver then votes failure) if it cannot. `abort` after
        it releases what it acquired.
        """
        with self._state_lock:
            if self._pending is None or version != self._pending:
                raise VersionError(
                    f"prepare of version {version}, but the pending version is {self._pending}"
                )
            missing = [b.index for b in self._layout.buckets if b.index not in self._received]
            if missing:
                raise IncompleteSyncError(
                    f"version {version} is missing {len(missing)} of {len(self._layout.buckets)} buckets "
                    f"(first: bucket {missing[0]})"
                )
            self._prepare(version, deadline)
            self._prepared = version

    def commit(self, version: int) -> None:
        with self._state_lock:
            if self._pending is None or version != self._pending:
                raise VersionError(f"commit of version {version}, but the pending version is {self._pending}")
            missing = [b.index for b in self._layout.buckets if b.index not in self._received]
            if missing:
                first = self._layout.buckets[missing[0]]
                error = IncompleteSyncError(
                    f"version {version} is missing {len(missing)} of {len(self._layout.buckets)} buckets "
                    f"(first: bucket {first.index}, holding {first.tensors[0].name!r})"
                )
                self.abort(error)
                raise error
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
            self._drop()
        finally:
            self._pending = None
            self._prepared = None
            self._received = set()

    # -- strategy hooks -------------------------------------------------------------------
    def _begin(self, version: int) -> None:  # pragma: no cover - trivial default
        pass

    def _prepare(self, version: int, deadline: Deadline) -> None:  # pragma: no cover - trivial default
        pass

    def _stage(self, index: int, data: torch.Tensor) -> None:
        raise NotImplementedError

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


def _copy_pairs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair: on CPU shared among a few threads (`copy_tensors`),
    since one thread copies at a fraction of the memory bus and a receiver's copy of the last
    bucket (or the commit's copy of the whole model) is time the sync waits for."""
    if not dsts:
        return
    with torch.no_grad():
        if all(t.device.type == "cpu" for t in dsts) and all(t.device.type == "cpu" for t in srcs):
            copy_tensors(dsts, srcs)
        else:
            _copy_all(dsts, srcs)


def _copy_bucket_except(
    region: torch.Tensor, data: torch.Tensor, layout: Layout, index: int, skip: set[str]
) -> None:
    """``region <- data`` for bucket `index` (flat uint8), except the bytes of tensors in `skip`.

    Nothing to do when `data` already is `region` (the transport landed the bucket there).
    """
    if data.numel() == 0 or (data.device == region.device and data.data_ptr() == region.data_ptr()):
        return
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    cursor = 0
    for spec in layout.buckets[index].tensors if skip else ():
        if spec.name in skip:
            if spec.offset > cursor:
                dsts.append(region[cursor : spec.offset])
                srcs.append(data[cursor : spec.offset])
            cursor = max(cursor, spec.offset + spec.nbytes)
    if cursor < data.numel():
        dsts.append(region[cursor:])
        srcs.append(data[cursor:])
    _copy_pairs(dsts, srcs)


def _unpack_except(
    layout: Layout, index: int, data: torch.Tensor, destination: Mapping[str, torch.Tensor], skip: set[str]
) -> None:
    """`unpack_bucket_into`, leaving the tensors in `skip` (already written in place) alone."""
    views = bucket_views(layout, index, data)
    names = [name for name in views if name not in skip]
    _copy_pairs([destination[n] for n in names], [views[n] for n in names])


class _LandingMixin:
    """`BucketTarget` / `TensorTarget` for a buffer: where a transport may write the pending version.

    A subclass says where bucket `index` / tensor `name` of the pending version lives
    (`_flat_pending`, `_tensor_home`); targets are handed out only while a version is pending.
    A tensor target is remembered, so `consume` does not overwrite it with the (unspecified)
    bytes the bucket then holds for it. The transport writes a target only if it lives on its
    device, and ``consume`` receives data on that device: a remembered tensor on another device
    than the data was not written, and is copied as usual.
    """

    _layout: Layout
    _pending: int | None
    _state_lock: threading.RLock
    _starts: list[int]
    _landed: dict[str, torch.device]

    def _flat_pending(self) -> torch.Tensor | None:
        """A flat uint8 buffer of every bucket back to back (`bucket_starts`), or None."""
        return None

    def _tensor_home(self, name: str) -> torch.Tensor | None:
        return None

    def _on_land(self) -> None:
        pass

    def bucket_target(self, index: int) -> torch.Tensor | None:
        """Bucket `index`'s region of the pending flat staging buffer, if there is one."""
        with self._state_lock:
            buckets = self._layout.buckets
            if self._pending is None or isinstance(index, bool) or not isinstance(index, int):
                return None
            if not 0 <= index < len(buckets):
                return None
            flat = self._flat_pending()
            if flat is None:
                return None
            start = self._starts[index]
            return flat[start : start + buckets[index].nbytes]

    def tensor_target(self, name: str) -> torch.Tensor | None:
        """Where tensor `name` of the pending version lives, if contiguous and of its layout type."""
        with self._state_lock:
            if self._pending is None or name not in self._layout:
                return None
            spec = self._layout[name]
            home = self._tensor_home(name)
            if (
                home is None
                or not home.is_contiguous()
                or home.dtype != spec.torch_dtype
                or tuple(home.shape) != spec.shape
            ):
                return None
            self._landed[name] = home.device
            self._on_land()
            return home.detach()

    def _landed_in(self, index: int, data: torch.Tensor) -> set[str]:
        """Tensors of bucket `index` the transport wrote in place (not to be copied from `data`)."""
        if not self._landed:
            return set()
        return {
            spec.name
            for spec in self._layout.buckets[index].tensors
            if self._landed.get(spec.name) == data.device
        }


class _ServingMixin:
    serving_lock: ServingLock
    commit_timeout_s: float | None

    @contextlib.contextmanager
    def serving(self, deadline: Deadline | float | None = None) -> Iterator[None]:
        """Hold around a forward pass: a commit waits for it, and it never sees half a version."""
        with self.serving_lock.shared(deadline):
            yield


class DirectBuffer(_LandingMixin, _ServingMixin, BufferBase):
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
        skip = self._landed_in(index, data)
        if self._staging is not None:
            start = self._starts[index]
            region = self._staging[start : start + data.numel()]
            _copy_bucket_except(region, data, self._layout, index, skip)
            return
        self.torn = True
        _unpack_except(self._layout, index, data, self.live, skip)

    def _publish(self, version: int) -> None:
        staging = self._staging
        if staging is not None:
            views = flat_views(self._layout, staging)
            names = list(views)
            with self.serving_lock.exclusive(self.commit_timeout_s):
                _copy_pairs([self.live[n] for n in names], [views[n] for n in names])
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


class DoubleBuffer(_LandingMixin, _ServingMixin, BufferBase):
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
        skip = self._landed_in(index, data)
        if self._flat is not None:
            start = self._starts[index]
            region = self._flat[start : start + data.numel()]
            _copy_bucket_except(region, data, self._layout, index, skip)
            return
        _unpack_except(self._layout, index, data, self.staging, skip)

    def _drop(self) -> None:
        self._landed = {}

    def _publish(self, version: int) -> None:
        self._landed = {}
        with self.serving_lock.exclusive(self.commit_timeout_s), torch.no_grad():
            if self.mode == "copy":
                names = list(self.live)
                _copy_pairs([self.live[n] for n in names], [self.staging[n] for n in names])
                return
            for name, tensor in self.live.items():
                previous = tensor.data
                tensor.data = self.staging[name]
                self.staging[name] = previous
