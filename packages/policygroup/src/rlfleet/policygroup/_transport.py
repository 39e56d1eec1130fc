"""Worker-side glue between a module and flat weight storage.

Byte layout and packing come from rlfleet.weightsync (`Layout`, `pack_bucket`, `flat_views`);
moving bytes between processes is weightsync's too (node `SharedBuffer`s, `BroadcastSender`
over world or member groups). What is left here: reading a module's weights by state-dict
name, and giving a module private flat storage again after it computed with views of a shared
or gathered buffer (a role change, a buffer rebuild).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from rlfleet.weightsync import Layout, bucket_starts, flat_views, pack_bucket


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
