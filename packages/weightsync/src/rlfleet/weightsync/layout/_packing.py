"""Packing tensors into bucket buffers and reading them back, bit-exact, for every dtype.

A bucket buffer is a flat uint8 tensor (CPU, shared memory or GPU). Tensors are written
through typed views of the buffer, so a non-contiguous source is copied once, straight into
place, and a receiver reads views of the buffer instead of copies.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlfleet.weightsync._errors import LayoutMismatchError, MetadataError
from rlfleet.weightsync.layout._copy import copy_pairs
from rlfleet.weightsync.layout._layout import Layout, TensorSpec


def typed_view(buffer: torch.Tensor, spec: TensorSpec) -> torch.Tensor:
    """The region of a bucket buffer that holds `spec`, viewed with its dtype and shape."""
    region = buffer[spec.offset : spec.offset + spec.nbytes]
    return region.view(spec.torch_dtype).view(spec.shape)


def _check_buffer(layout: Layout, index: int, buffer: torch.Tensor) -> int:
    if not 0 <= index < len(layout.buckets):
        raise MetadataError(f"bucket {index} does not exist (layout has {len(layout.buckets)})")
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"bucket buffers are flat uint8 tensors, got {buffer.dtype} with shape {tuple(buffer.shape)}"
        )
    nbytes = layout.buckets[index].nbytes
    if buffer.numel() < nbytes:
        raise ValueError(f"bucket {index} needs {nbytes} bytes, buffer holds {buffer.numel()}")
    return nbytes


def _source(tensors: Mapping[str, torch.Tensor], spec: TensorSpec, sending: bool = False) -> torch.Tensor:
    """`spec`'s tensor; a sender's may be in its source dtype (the copy into the bucket casts it)."""
    tensor = tensors.get(spec.name)
    if tensor is None:
        raise LayoutMismatchError(f"parameter {spec.name!r} is missing from the state dict", spec.name)
    fits = spec.takes(tensor) if sending else tensor.dtype == spec.torch_dtype
    if tuple(tensor.shape) != spec.shape or not fits:
        raise LayoutMismatchError(
            f"parameter {spec.name!r} is {tensor.dtype} {tuple(tensor.shape)}, "
            f"layout says {spec.dtype} {spec.shape}",
            spec.name,
        )
    return tensor


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _views(layout: Layout, index: int, buffer: torch.Tensor) -> list[torch.Tensor]:
    """Typed views of every tensor of bucket `index` in `buffer` (buffer already checked).

    One `as_strided` per tensor over one typed view per dtype: several times cheaper than
    slicing and viewing each region, which matters for buckets of thousands of small tensors.
    """
    bucket = layout.buckets[index]
    region = buffer[: bucket.nbytes]
    whole: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
    out = []
    for spec in bucket.tensors:
        dtype = spec.torch_dtype
        entry = whole.get(dtype)
        if entry is None:
            typed = region.view(dtype)  # bucket sizes are multiples of 512
            entry = whole[dtype] = (typed, int(typed.storage_offset()))  # as_strided: absolute offsets
        typed, base = entry
        out.append(
            typed.as_strided(
                spec.shape, _contiguous_strides(spec.shape), base + spec.offset // dtype.itemsize
            )
        )
    return out


def pack_bucket(
    layout: Layout, index: int, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor
) -> torch.Tensor:
    """Write bucket `index` of `tensors` into `buffer`; returns the bucket's slice of it.

    Tensors in their source dtype are cast to the wire dtype by this copy (once per version).
    """
    nbytes = _check_buffer(layout, index, buffer)
    sources = [_source(tensors, spec, sending=True).detach() for spec in layout.buckets[index].tensors]
    copy_pairs(_views(layout, index, buffer), sources, threaded=False)
    return buffer[:nbytes]


def bucket_views(layout: Layout, index: int, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views (no copies) of every tensor of bucket `index` inside `buffer`."""
    _check_buffer(layout, index, buffer)
    specs = layout.buckets[index].tensors
    return {spec.name: view for spec, view in zip(specs, _views(layout, index, buffer), strict=True)}


def unpack_bucket_into(
    layout: Layout, index: int, buffer: torch.Tensor, destination: Mapping[str, torch.Tensor]
) -> None:
    """Copy bucket `index` from `buffer` into the matching tensors of `destination`."""
    _check_buffer(layout, index, buffer)
    targets = [_source(destination, spec) for spec in layout.buckets[index].tensors]
    copy_pairs(targets, _views(layout, index, buffer), threaded=False)


def pack_all(
    layout: Layout, tensors: Mapping[str, torch.Tensor], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """One flat buffer holding every bucket back to back (bucket i at sum of sizes before it)."""
    out = torch.empty(layout.padded_bytes, dtype=torch.uint8, device=device)
    start = 0
    for bucket in layout.buckets:
        pack_bucket(layout, bucket.index, tensors, out[start : start + bucket.nbytes])
        start += bucket.nbytes
    return out


def bucket_starts(layout: Layout) -> list[int]:
    """Offset of each bucket inside a flat buffer of all buckets back to back."""
    starts, start = [], 0
    for bucket in layout.buckets:
        starts.append(start)
        start += bucket.nbytes
    return starts


def flat_views(layout: Layout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of every tensor inside a flat all-buckets buffer (see `pack_all`)."""
    if flat.numel() < layout.padded_bytes:
        raise ValueError(f"flat buffer holds {flat.numel()} bytes, layout needs {layout.padded_bytes}")
    views: dict[str, torch.Tensor] = {}
    for bucket, start in zip(layout.buckets, bucket_starts(layout), strict=True):
        views.update(bucket_views(layout, bucket.index, flat[start : start + bucket.nbytes]))
    return {name: views[name] for name in layout.names}
