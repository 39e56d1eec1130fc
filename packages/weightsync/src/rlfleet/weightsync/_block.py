"""A model's tensors kept in one block laid out like a flat all-buckets buffer.

Senders copy or send a model bucket by bucket. When the model's own tensors already lie in one
block at the layout's flat offsets (`flat_views` order), every bucket is a slice of that block:
a node writer copies the whole block at once (one copy large enough for the C library's
streaming stores) and a broadcast sends the slices as they are (no packing copy). `adopt` puts
a model's tensors there once; `flat_block` recognizes such a state dict on each send.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch

from rlfleet.weightsync._buffers import live_tensors
from rlfleet.weightsync._copy import copy_tensors
from rlfleet.weightsync._layout import Layout
from rlfleet.weightsync._packing import bucket_starts, flat_views

__all__ = ["adopt", "flat_block"]


def adopt(live: Mapping[str, torch.Tensor] | torch.nn.Module, layout: Layout) -> torch.Tensor:
    """Move `live`'s tensors into one block laid out as `layout`'s flat buffer; return the block.

    Each tensor's ``.data`` becomes its view in the block: values are kept, and Parameter
    objects (and the optimizers that hold them) are the same objects. The old storages are
    freed if nothing else holds them. Pass a module or a ``state_dict(keep_vars=True)``
    (``keep_vars=False`` returns detached aliases: rebinding them does not reach the module).
    The block is on the tensors' device; they must all be on one.
    """
    targets = live_tensors(live) if isinstance(live, torch.nn.Module) else dict(live)
    layout.check_state_dict(targets)
    devices = sorted({str(t.device) for t in targets.values()})
    if len(devices) > 1:
        raise ValueError(f"adopt: the tensors are on several devices {devices}; one block needs one")
    device = torch.device(devices[0]) if devices else torch.device("cpu")
    block = torch.empty(layout.padded_bytes, dtype=torch.uint8, device=device)
    views = flat_views(layout, block)
    names = layout.names
    with torch.no_grad():
        if device.type == "cpu":
            copy_tensors([views[n] for n in names], [targets[n].detach() for n in names])
        else:
            torch._foreach_copy_([views[n] for n in names], [targets[n].detach() for n in names])
        for name in names:
            targets[name].data = views[name]
    return block


@lru_cache(maxsize=16)  # equal layouts (same digest) place every tensor alike
def _flat_offsets(layout: Layout) -> tuple[int, ...]:
    """Offset of each tensor (layout order) inside the flat all-buckets buffer."""
    offsets: dict[str, int] = {}
    for bucket, start in zip(layout.buckets, bucket_starts(layout), strict=True):
        for spec in bucket.tensors:
            offsets[spec.name] = start + spec.offset
    return tuple(offsets[name] for name in layout.names)


def flat_block(layout: Layout, state_dict: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """The block `state_dict`'s tensors are contiguous views of, at the layout's flat offsets.

    None when any tensor lies elsewhere (one moved out, a non-contiguous view, another device),
    or no tensor has bytes: the caller then copies tensor by tensor, with the same result. Only a
    ``dict`` is inspected: another mapping may produce each tensor when it is read (a gather),
    and is never read ahead of the sender's own order.
    """
    if not isinstance(state_dict, dict):
        return None
    first: torch.Tensor | None = None
    base = 0
    for name, offset in zip(layout.names, _flat_offsets(layout), strict=True):
        tensor = state_dict[name]
        if not tensor.numel():  # an empty tensor has no bytes, and no address to check
            continue
        if first is None:
            first, base = tensor, tensor.data_ptr() - offset
        elif tensor.data_ptr() != base + offset or tensor.device != first.device:
            return None
        if not tensor.is_contiguous():
            return None
    if first is None:
        return None
    storage = first.untyped_storage()
    begin = base - storage.data_ptr()
    if begin < 0 or begin + layout.padded_bytes > storage.nbytes():
        return None  # the tensors lie at the right distances, but not inside one storage
    block = torch.empty(0, dtype=torch.uint8, device=first.device)
    return block.set_(storage, begin, (layout.padded_bytes,), (1,))
