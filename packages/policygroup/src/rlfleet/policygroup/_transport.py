"""Worker-side weight movement glue: node segments, binding a module to flat buffers, broadcasts.

Private adapter: byte layout and packing come from rlfleet.weightsync (`Layout`, `pack_bucket`,
`flat_views`); this module only decides where a version's bytes live in a worker process.
Every eval model keeps its weights as views into one flat uint8 buffer (a slot), so a swap to
a new version is a rebind of views (no copy), and a "Shared" slot is a file in /dev/shm that
every eval policy of the node maps.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.weightsync import (
    Layout,
    PeerLostError,
    SyncTimeoutError,
    bucket_starts,
    flat_views,
    pack_bucket,
)

_c10d: Any = dist  # TCPStore / PrefixStore / ProcessGroup* are not re-exported for mypy

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"


def segment_path(name: str) -> str:
    if "/" in name or not name:
        raise ValueError(f"segment name must be a plain file name, got {name!r}")
    return os.path.join(SHM_DIR, name)


def map_segment(name: str, nbytes: int, create: bool) -> torch.Tensor:
    """A flat uint8 tensor over a shared file of `nbytes` bytes (created and sized if asked)."""
    path = segment_path(name)
    if create:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < nbytes:
                os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
    elif not os.path.exists(path):
        raise FileNotFoundError(f"shared weight segment {path!r} does not exist (not written on this node?)")
    size = os.path.getsize(path)
    if size < nbytes:
        raise ValueError(f"shared weight segment {path!r} holds {size} bytes, {nbytes} needed")
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def unlink_segment(name: str) -> bool:
    try:
        os.unlink(segment_path(name))
        return True
    except FileNotFoundError:
        return False


def state_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers, by state-dict name, detached (what a sync moves)."""
    return {k: v.detach() for k, v in module.state_dict(keep_vars=True).items()}


def pack_into(layout: Layout, state: Mapping[str, torch.Tensor], flat: torch.Tensor) -> None:
    """Pack every bucket of `state` into the flat all-buckets buffer `flat`."""
    with torch.no_grad():
        for bucket, start in zip(layout.buckets, bucket_starts(layout), strict=True):
            pack_bucket(layout, bucket.index, state, flat[start : start + bucket.nbytes])


def bind_module(module: torch.nn.Module, layout: Layout, flat: torch.Tensor) -> None:
    """Make every parameter / buffer of `module` a view into `flat` (zero-copy apply)."""
    views = flat_views(layout, flat)
    with torch.no_grad():
        for name, view in views.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            if leaf in owner._parameters and owner._parameters[leaf] is not None:
                param = owner._parameters[leaf]
                assert param is not None
                param.data = view
            elif leaf in owner._buffers:
                owner._buffers[leaf] = view
            else:
                raise KeyError(f"state entry {name!r} is neither a parameter nor a buffer of the module")


def copy_module_into(module: torch.nn.Module, layout: Layout, flat: torch.Tensor) -> None:
    """Copy the module's current weights into `flat` (to move a model onto a flat slot)."""
    pack_into(layout, state_of(module), flat)


def broadcast_flat(
    flat: torch.Tensor,
    layout: Layout,
    root: int,
    group: Any,
    timeout_s: float,
    what: str,
) -> None:
    """Broadcast every bucket of `flat` from group rank `root` of process group `group`.

    Two buckets in flight; each wait carries what is left of the deadline.
    """
    end = time.monotonic() + timeout_s
    works: list[Any] = []
    for bucket, start in zip(layout.buckets, bucket_starts(layout), strict=True):
        view = flat[start : start + bucket.nbytes]
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.rootTensor = 0
        works.append(group.broadcast([view], opts))
        if len(works) >= 2:
            _wait(works.pop(0), end, what)
    for work in works:
        _wait(work, end, what)


def _wait(work: Any, end: float, what: str) -> None:
    remaining = end - time.monotonic()
    if remaining <= 0:
        raise SyncTimeoutError(f"{what}: deadline passed before the broadcast finished")
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=remaining))
    except RuntimeError as exc:
        raise PeerLostError(
            f"{what}: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}"
        ) from exc
    if ok is False:
        raise SyncTimeoutError(f"{what}: broadcast did not finish within its deadline")


def make_process_group(
    store: Any, prefix: str, group_rank: int, size: int, timeout_s: float, backend: str
) -> Any:
    """A standalone process group among the members only (any creation order, any overlap)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    scoped = _c10d.PrefixStore(prefix, store)
    if backend == "nccl":  # pragma: no cover - needs GPUs
        return _c10d.ProcessGroupNCCL(scoped, group_rank, size)
    return _c10d.ProcessGroupGloo(scoped, group_rank, size, timeout)
