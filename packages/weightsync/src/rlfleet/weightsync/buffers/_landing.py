"""Where a transport may land the pending version of a buffer, and the copies that skip what landed.

`DirectBuffer` and `DoubleBuffer` offer their pending storage as landing zones (the wire's
`BucketTarget` / `TensorTarget`), so a broadcast writes received bytes straight into place
instead of into a bucket buffer that `consume` copies again: a whole bucket into a flat
staging buffer (atomic "None", "Double" copy mode), one large tensor into its staging tensor
("Double" swap mode) or, for the non-atomic in-place "None", into the live tensor itself. The
targets exist only while a version is pending (between `begin` and `commit`/`abort`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch

from rlfleet.weightsync.codec._delta_state import pack_base, tensor_pieces
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_views

__all__ = ["LandingMixin", "copy_bucket_except", "unpack_except"]


def copy_bucket_except(
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
    copy_pairs(dsts, srcs)


def unpack_except(
    layout: Layout, index: int, data: torch.Tensor, destination: Mapping[str, torch.Tensor], skip: set[str]
) -> None:
    """`unpack_bucket_into`, leaving the tensors in `skip` (already written in place) alone."""
    views = bucket_views(layout, index, data)
    names = [name for name in views if name not in skip]
    copy_pairs([destination[n] for n in names], [views[n] for n in names])


class LandingMixin:
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

    def copy_base(self, index: int, out: torch.Tensor) -> bool:
        """Bucket `index` of the applied version (the live tensors) into `out`, padding zeroed:
        the base a delta is rebuilt on (`codec.DeltaBase`), in the place the full bucket lands."""
        live: Mapping[str, torch.Tensor] | None = getattr(self, "live", None)
        if live is None:
            return False
        with self._state_lock:
            return pack_base(self._layout, index, live, out)

    def base_pieces(self, index: int) -> list[tuple[int, torch.Tensor]] | None:
        """The live tensors of bucket `index` as a delta's base without a copy (`codec.DeltaBase`)."""
        live: Mapping[str, torch.Tensor] | None = getattr(self, "live", None)
        if live is None:
            return None
        with self._state_lock:
            return tensor_pieces(self._layout, index, live)

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

    def _land(
        self, index: int, data: torch.Tensor, flat: torch.Tensor | None, tensors: Mapping[str, torch.Tensor]
    ) -> None:
        """Bucket `index` into the flat pending buffer if there is one, else into `tensors`,
        leaving alone what the transport already wrote in place."""
        skip = self._landed_in(index, data)
        if flat is not None:
            start = self._starts[index]
            copy_bucket_except(flat[start : start + data.numel()], data, self._layout, index, skip)
        else:
            unpack_except(self._layout, index, data, tensors, skip)

    def _landed_in(self, index: int, data: torch.Tensor) -> set[str]:
        """Tensors of bucket `index` the transport wrote in place (not to be copied from `data`)."""
        if not self._landed:
            return set()
        return {
            spec.name
            for spec in self._layout.buckets[index].tensors
            if self._landed.get(spec.name) == data.device
        }
