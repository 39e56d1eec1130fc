"""A `BucketConsumer` that records what a transport did to it: the test double weightsync ships.

Code that drives consumers (a transport, an engine adapter, a test of either) needs a consumer
that behaves like a real one and tells afterwards what happened, the way an SDK ships an
in-memory exporter. `RecordingConsumer` stages every bucket, applies a version to its own
``weights`` on commit (bit-exact, so a test compares checksums), keeps the calls in order, can
offer its staging as landing zones, and fails on request at a chosen step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from rlfleet.weightsync._core import check_version
from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import IncompleteSyncError, VersionError, WeightSyncError
from rlfleet.weightsync._layout import Layout
from rlfleet.weightsync._packing import bucket_starts, flat_views

__all__ = ["RecordingConsumer"]


class RecordingConsumer:
    """A staging consumer that records every call (`calls`) and applies versions to `weights`.

    - `weights`: name -> tensor of the applied version (zeros, or clones of `initial`).
    - `calls`: ``(method, argument)`` in order: ``("begin", v)``, ``("consume", index)``,
      ``("prepare_commit", v)``, ``("commit", v)``, ``("abort", "Type: message")``.
    - `aborts`: the same abort lines; `landed`: tensors a transport wrote in place.
    - ``bucket_targets=True`` offers the staging as `BucketTarget`; ``tensor_targets=True``
      offers each tensor's staging as `TensorTarget`.
    - Failures on request: `fail_on` (a bucket index whose `consume` raises), `fail_prepare`
      and `fail_commit` (exceptions `prepare_commit` / `commit` raise).
    """

    def __init__(
        self,
        layout: Layout,
        initial: Mapping[str, torch.Tensor] | None = None,
        *,
        bucket_targets: bool = False,
        tensor_targets: bool = False,
    ) -> None:
        self._layout = layout
        if initial is None:
            self.weights = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in layout.tensors}
        else:
            layout.check_state_dict(initial)
            self.weights = {k: v.detach().clone().contiguous() for k, v in initial.items()}
        self.staging = torch.zeros(layout.padded_bytes, dtype=torch.uint8)
        self._starts = bucket_starts(layout)
        self._version = -1
        self._pending: int | None = None
        self._seen: set[int] = set()
        self.bucket_targets = bucket_targets
        self.tensor_targets = tensor_targets
        self.landed: set[str] = set()
        self.calls: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self.fail_on: int | None = None
        self.fail_prepare: BaseException | None = None
        self.fail_commit: BaseException | None = None

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def version(self) -> int:
        return self._version

    @property
    def pending_version(self) -> int | None:
        return self._pending

    def _region(self, index: int) -> torch.Tensor:
        start = self._starts[index]
        return self.staging[start : start + self._layout.buckets[index].nbytes]

    def begin(self, version: int) -> None:
        self.calls.append(("begin", version))
        check_version(version)
        if version <= self._version:
            raise VersionError(f"version {version} is not newer than the applied version {self._version}")
        self._pending = version
        self._seen = set()
        self.landed = set()

    def bucket_target(self, index: int) -> torch.Tensor | None:
        if not self.bucket_targets or self._pending is None or not 0 <= index < len(self._layout.buckets):
            return None
        return self._region(index)

    def tensor_target(self, name: str) -> torch.Tensor | None:
        if not self.tensor_targets or self._pending is None or name not in self._layout:
            return None
        spec = self._layout[name]
        self.landed.add(name)
        region = self._region(spec.bucket)[spec.offset : spec.offset + spec.nbytes]
        return region.view(spec.torch_dtype).view(spec.shape)

    def consume(self, index: int, data: torch.Tensor) -> None:
        self.calls.append(("consume", index))
        if self._pending is None:
            raise WeightSyncError(f"bucket {index} arrived outside a sync")
        if self.fail_on == index:
            raise RuntimeError(f"injected consumer failure at bucket {index}")
        region = self._region(index)
        if data.data_ptr() != region.data_ptr():
            for spec in self._layout.buckets[index].tensors:
                if spec.name not in self.landed:  # landed tensors are already in place
                    end = spec.offset + spec.nbytes
                    region[spec.offset : end].copy_(data[spec.offset : end])
        self._seen.add(index)

    def prepare_commit(
        self, version: int, deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S
    ) -> None:
        self.calls.append(("prepare_commit", version))
        self._check_complete(version)
        if self.fail_prepare is not None:
            raise self.fail_prepare

    def _check_complete(self, version: int) -> None:
        if self._pending != version:
            raise VersionError(f"commit of version {version}, but the pending version is {self._pending}")
        missing = [b.index for b in self._layout.buckets if b.index not in self._seen]
        if missing:
            raise IncompleteSyncError(f"version {version} is missing buckets {missing}")

    def commit(self, version: int) -> None:
        self.calls.append(("commit", version))
        self._check_complete(version)
        if self.fail_commit is not None:
            raise self.fail_commit
        for name, view in flat_views(self._layout, self.staging).items():
            self.weights[name].copy_(view)
        self._version = version
        self._pending = None

    def abort(self, error: BaseException) -> None:
        line = f"{type(error).__name__}: {error}"
        self.calls.append(("abort", line))
        self.aborts.append(line)
        self._pending = None

    def methods(self) -> list[str]:
        """The names of the calls so far, in order (``["begin", "consume", ...]``)."""
        return [name for name, _ in self.calls]
