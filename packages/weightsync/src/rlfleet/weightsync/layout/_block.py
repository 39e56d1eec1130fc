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

from rlfleet.weightsync.layout._copy import copy_tensors
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._packing import bucket_starts, flat_views

__all__ = ["adopt", "flat_block", "live_tensors"]


def live_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a module actually computes with (parameters and persistent buffers), by name.

    ``state_dict(keep_vars=True)``: the Parameter / buffer objects themselves, so in-place
    copies and ``.data`` swaps reach the module (``keep_vars=False`` returns detached aliases,
    whose ``.data`` can be swapped without the module noticing).
    """
    return dict(module.state_dict(keep_vars=True))


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor reads: [start, end) from the storage's beginning."""
    start = int(tensor.storage_offset()) * tensor.element_size()
    if not tensor.numel():
        return start, start
    extent = sum((int(size) - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (extent + 1) * tensor.element_size()


def _overlapping_runs(spans: Mapping[str, tuple[int, int]]) -> list[list[str]]:
    """Names whose byte spans overlap, chained: each run of two or more, in storage order."""
    runs: list[list[str]] = []
    end = -1
    for name in sorted(spans, key=lambda n: spans[n]):
        start, stop = spans[name]
        if runs and start < end:
            runs[-1].append(name)
        else:
            runs.append([name])
        end = max(end, stop) if runs[-1][0] != name else stop
    return [run for run in runs if len(run) > 1]


def _views_of_others(targets: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Tensors that are views into another tensor of `targets`: name -> the name holding them.

    Tensors whose bytes overlap must all lie inside one contiguous tensor among them (a view of
    a parameter, a slice of a buffer): they then point into that holder's place in the block.
    Overlapping tensors without such a holder cannot stay shared in one block: ValueError.
    """
    groups: dict[tuple[str, int], dict[str, tuple[int, int]]] = {}
    seen: set[int] = set()
    for name, tensor in targets.items():
        if id(tensor) in seen or not tensor.numel():
            continue  # the same object under two names (tied weights) stays one object
        seen.add(id(tensor))
        key = (str(tensor.device), tensor.untyped_storage().data_ptr())
        groups.setdefault(key, {})[name] = _byte_span(tensor)
    holders: dict[str, str] = {}
    for spans in groups.values():
        for run in _overlapping_runs(spans):
            lo, hi = min(spans[n][0] for n in run), max(spans[n][1] for n in run)
            holder = next((n for n in run if spans[n] == (lo, hi) and targets[n].is_contiguous()), None)
            if holder is None:
                raise ValueError(
                    f"adopt: {run[0]!r} and {run[1]!r} share memory but no contiguous tensor holds all of "
                    f"{run}; one block cannot keep them shared (clone one of them first)"
                )
            holders.update({n: holder for n in run if n != holder})
    return holders


def adopt(live: Mapping[str, torch.Tensor] | torch.nn.Module, layout: Layout) -> torch.Tensor:
    """Move `live`'s tensors into one block laid out as `layout`'s flat buffer; return the block.

    Each tensor's ``.data`` becomes its view in the block: values are kept, and Parameter
    objects (and the optimizers that hold them) are the same objects. The old storages are
    freed if nothing else holds them. Pass a module or a ``state_dict(keep_vars=True)``
    (``keep_vars=False`` returns detached aliases: rebinding them does not reach the module).
    The block is on the tensors' device; they must all be on one. Tensors that were views of
    another one stay views of it (inside its place in the block; a send then takes the
    per-tensor path for them); overlapping tensors where neither holds the other are refused.
    """
    targets = live_tensors(live) if isinstance(live, torch.nn.Module) else dict(live)
    if layout.casts:
        raise ValueError(
            "adopt: the layout casts tensors to a wire dtype; adopt the trainer's tensors with a layout "
            "of their own dtypes (the block keeps the values, not a cast of them)"
        )
    layout.check_state_dict(targets)
    devices = sorted({str(t.device) for t in targets.values()})
    if len(devices) > 1:
        raise ValueError(f"adopt: the tensors are on several devices {devices}; one block needs one")
    holders = _views_of_others(targets)
    device = torch.device(devices[0]) if devices else torch.device("cpu")
    block = torch.empty(layout.padded_bytes, dtype=torch.uint8, device=device)
    views = flat_views(layout, block)
    names = layout.names
    with torch.no_grad():
        if device.type == "cpu":
            copy_tensors([views[n] for n in names], [targets[n].detach() for n in names])
        else:
            torch._foreach_copy_([views[n] for n in names], [targets[n].detach() for n in names])
        inside = {n: _byte_span(targets[n])[0] - _byte_span(targets[holders[n]])[0] for n in holders}
        for name in names:
            if name not in holders:
                targets[name].data = views[name]
        for name, holder in holders.items():
            tensor, home = targets[name], targets[holder]
            start = home.storage_offset() * home.element_size() + inside[name]
            view = torch.empty(0, dtype=tensor.dtype, device=device)
            view.set_(home.untyped_storage(), start // tensor.element_size(), tensor.shape, tensor.stride())
            tensor.data = view
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
    if not isinstance(state_dict, dict) or layout.casts:
        return None  # a cast layout's bytes are not the tensors' bytes
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
