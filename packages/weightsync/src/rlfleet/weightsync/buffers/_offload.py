"""Offload and reload of parameters, gradients, buffers and optimizer state, bit-exact.

Offload works on *storages*, as FSDP does: each distinct storage behind the tensors is copied
to the offload device (pinned host memory when a GPU is present) and then resized to zero,
which frees its memory at once, even while other tensors still alias it. Reload resizes the
same storage back and copies the bytes in, so every alias (the Parameter objects an optimizer
holds, views, tied weights, `state_dict` tensors) is valid again and sees identical bytes.
Touching an offloaded tensor raises (its storage is empty) instead of reading stale values.

Storages that cannot be resized (tensors over shared memory or numpy, e.g. a module bound to a
`SharedBuffer`) hold no private memory and are skipped.

Stream contract: offload synchronizes every CUDA device it copies from or to (all streams of
each, not only the current device's current stream) before it copies, so writes the caller
queued on any stream are in the copy, and again after, so the host copy is complete before
anyone reads it and before the device storage is freed. Reload synchronizes every device it
copied to before it returns: the tensors are usable from any stream. ``empty_cache=True``
returns the freed blocks of torch's caching allocator to the driver, for a colocated process
(a rollout engine on the same GPU) that allocates outside this process's cache.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

__all__ = [
    "OffloadStats",
    "is_offloaded",
    "offload_module",
    "offload_optimizer",
    "reload_module",
    "reload_optimizer",
]


@dataclass
class _Saved:
    storage: torch.UntypedStorage
    copy: torch.Tensor  # flat uint8 on the offload device
    nbytes: int


@dataclass
class OffloadStats:
    """What one offload or reload moved."""

    storages: int = 0
    nbytes: int = 0
    skipped: int = field(default=0)


# Keyed by the module / optimizer object; entries disappear with it.
_offloaded: weakref.WeakKeyDictionary[object, list[_Saved]] = weakref.WeakKeyDictionary()


def _pin_default(target: torch.device) -> bool:
    return target.type == "cpu" and torch.cuda.is_available()


def _flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, 0, (storage.nbytes(),), (1,))
    return flat


def _synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for every stream of each distinct CUDA device among `devices`."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


def _private_storages(tensors: Iterable[torch.Tensor], stats: OffloadStats) -> list[torch.UntypedStorage]:
    """Each distinct non-empty storage once; storages that cannot be resized are counted as skipped."""
    out: list[torch.UntypedStorage] = []
    seen: set[tuple[torch.device, int]] = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key in seen or storage.nbytes() == 0:
            continue
        seen.add(key)
        if storage.resizable():
            out.append(storage)
        else:
            stats.skipped += 1
    return out


def _offload(
    owner: object,
    tensors: Iterable[torch.Tensor],
    device: str | torch.device,
    pin_memory: bool | None,
    empty_cache: bool,
) -> OffloadStats:
    stats = OffloadStats()
    if owner in _offloaded:
        return stats  # already offloaded: nothing left to move
    target = torch.device(device)
    pin = _pin_default(target) if pin_memory is None else pin_memory
    storages = _private_storages(tensors, stats)
    devices = [s.device for s in storages] + [target]
    pinned = pin and target.type == "cpu"
    saved: list[_Saved] = []
    with torch.no_grad():
        _synchronize(devices)  # writes queued on any stream land before the copy reads
        for storage in storages:
            nbytes = storage.nbytes()
            copy = torch.empty(nbytes, dtype=torch.uint8, device=target, pin_memory=pinned)
            copy.copy_(_flat_bytes(storage), non_blocking=pin)
            saved.append(_Saved(storage, copy, nbytes))
        _synchronize(devices)  # every copy done before host reads and before the storages go
        for item in saved:
            item.storage.resize_(0)
            stats.storages += 1
            stats.nbytes += item.nbytes
    if empty_cache and any(d.type == "cuda" for d in devices):
        torch.cuda.empty_cache()
    _offloaded[owner] = saved
    return stats


def _reload(owner: object) -> OffloadStats:
    stats = OffloadStats()
    saved = _offloaded.pop(owner, None)
    if saved is None:
        return stats
    with torch.no_grad():
        for item in saved:
            item.storage.resize_(item.nbytes)
            _flat_bytes(item.storage).copy_(item.copy, non_blocking=item.copy.is_pinned())
            stats.storages += 1
            stats.nbytes += item.nbytes
        _synchronize([d for item in saved for d in (item.storage.device, item.copy.device)])
    return stats


def _module_tensors(module: torch.nn.Module, grads: bool, buffers: bool) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for param in module.parameters():
        out.append(param)
        if grads and param.grad is not None:
            out.append(param.grad)
    if buffers:
        out.extend(module.buffers())
    return out


def offload_module(
    module: torch.nn.Module,
    device: str | torch.device = "cpu",
    *,
    grads: bool = True,
    buffers: bool = True,
    pin_memory: bool | None = None,
    empty_cache: bool = False,
) -> OffloadStats:
    """Move a module's parameters (and grads, buffers) to `device` and free their memory.

    `pin_memory` defaults to True when offloading to CPU on a machine with CUDA. A second
    offload before `reload_module` is a no-op. `empty_cache` hands the freed GPU memory back to
    the driver (for a colocated process), not only to this process's caching allocator.
    """
    return _offload(module, _module_tensors(module, grads, buffers), device, pin_memory, empty_cache)


def reload_module(module: torch.nn.Module) -> OffloadStats:
    """Bring back what `offload_module` moved, bit-exact, into the same storages."""
    return _reload(module)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def offload_optimizer(
    optimizer: torch.optim.Optimizer,
    device: str | torch.device = "cpu",
    *,
    pin_memory: bool | None = None,
    empty_cache: bool = False,
) -> OffloadStats:
    """Move the optimizer's state tensors (moments, steps) to `device` and free their memory."""
    return _offload(optimizer, _optimizer_tensors(optimizer), device, pin_memory, empty_cache)


def reload_optimizer(optimizer: torch.optim.Optimizer) -> OffloadStats:
    """Bring back what `offload_optimizer` moved, bit-exact."""
    return _reload(optimizer)


def is_offloaded(owner: torch.nn.Module | torch.optim.Optimizer) -> bool:
    return owner in _offloaded
