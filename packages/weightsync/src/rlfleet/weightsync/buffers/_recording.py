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

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync.buffers._buffers import BufferBase
from rlfleet.weightsync.codec._delta_state import pack_base, tensor_pieces
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import flat_views

__all__ = ["RecordingConsumer"]


class RecordingConsumer(BufferBase):
    """A staging consumer that records every call (`calls`) and applies versions to `weights`.

    - `weights`: name -> tensor of the applied version (zeros, or clones of `initial`).
    - `calls`: ``(method, argument)`` in order: ``("begin", v)``, ``("consume", index)``,
      ``("prepare_commit", v)``, ``("commit", v)``, ``("abort", "Type: message")``.
    - `aborts`: the same abort lines; `landed`: tensors a transport wrote in place;
      `landed_buckets`: buckets a transport wrote straight into the staging (this version).
    - ``bucket_targets=True`` offers the staging as `BucketTarget`; ``tensor_targets=True``
      offers each tensor's staging as `TensorTarget`.
    - Failures on request: `fail_on` (a bucket index whose `consume` raises), `fail_prepare`
      and `fail_commit` (exceptions `prepare_commit` / `commit` raise).

    Its bookkeeping is a weight buffer's (`BufferBase`): the same version, bucket and prepare
    checks, so what passes against it passes against the real buffers.
    """

    def __init__(
        self,
        layout: Layout,
        initial: Mapping[str, torch.Tensor] | None = None,
        *,
        bucket_targets: bool = False,
        tensor_targets: bool = False,
    ) -> None:
        super().__init__(layout)
        if initial is None:
            self.weights = {s.name: torch.zeros(s.shape, dtype=s.torch_dtype) for s in layout.tensors}
        else:
            layout.check_state_dict(initial)
            self.weights = {k: v.detach().clone().contiguous() for k, v in initial.items()}
        self.staging = torch.zeros(layout.padded_bytes, dtype=torch.uint8)
        self.bucket_targets = bucket_targets
        self.tensor_targets = tensor_targets
        self.landed: set[str] = set()
        self.landed_buckets: set[int] = set()
        self.calls: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self.fail_on: int | None = None
        self.fail_prepare: BaseException | None = None
        self.fail_commit: BaseException | None = None

    def _region(self, index: int) -> torch.Tensor:
        start = self._starts[index]
        return self.staging[start : start + self._layout.buckets[index].nbytes]

    # -- the consumer calls, recorded --------------------------------------------------------
    def begin(self, version: int) -> None:
        self.calls.append(("begin", version))
        super().begin(version)

    def consume(self, index: int, data: torch.Tensor) -> None:
        self.calls.append(("consume", index))
        super().consume(index, data)

    def prepare_commit(
        self, version: int, deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S
    ) -> None:
        self.calls.append(("prepare_commit", version))
        super().prepare_commit(version, deadline)

    def commit(self, version: int) -> None:
        self.calls.append(("commit", version))
        super().commit(version)

    def abort(self, error: BaseException) -> None:
        line = f"{type(error).__name__}: {error}"
        self.calls.append(("abort", line))
        self.aborts.append(line)
        super().abort(error)

    def methods(self) -> list[str]:
        """The names of the calls so far, in order (``["begin", "consume", ...]``)."""
        return [name for name, _ in self.calls]

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        """Bucket `index` of the applied version, `weights`, into `out` (a delta's base)."""
        return pack_base(self._layout, index, self.weights, out)

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        """`weights`' bucket `index` as a delta's base without a copy."""
        return tensor_pieces(self._layout, index, self.weights)

    # -- landing zones -----------------------------------------------------------------------
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

    # -- BufferBase hooks ----------------------------------------------------------------------
    def _begin(self, version: int) -> None:
        self.landed = set()
        self.landed_buckets = set()

    def _stage(self, index: int, data: torch.Tensor) -> None:
        if self.fail_on == index:
            raise RuntimeError(f"injected consumer failure at bucket {index}")
        region = self._region(index)
        if data.data_ptr() == region.data_ptr():
            self.landed_buckets.add(index)
        else:
            for spec in self._layout.buckets[index].tensors:
                if spec.name not in self.landed:  # landed tensors are already in place
                    end = spec.offset + spec.nbytes
                    region[spec.offset : end].copy_(data[spec.offset : end])

    def _prepare(self, version: int, deadline: Deadline) -> None:
        if self.fail_prepare is not None:
            raise self.fail_prepare

    def _publish(self, version: int) -> None:
        if self.fail_commit is not None:
            raise self.fail_commit
        for name, view in flat_views(self._layout, self.staging).items():
            self.weights[name].copy_(view)
