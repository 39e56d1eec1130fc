"""The receiving side shared by the delta tests' process bodies (ShmRing, CUDA IPC, reshard):
a DoubleBuffer or a node buffer as the consumer, each with a way to read back what it serves,
a corrupted node-buffer base, and the file signals the processes pass between them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
import wire_workers as ww

from rlfleet.weightsync import DoubleBuffer, Layout, SharedBuffer, SharedBufferReader

Served = Callable[[], dict[str, torch.Tensor]]


def double_reader(template: Mapping[str, torch.Tensor], layout: Layout) -> tuple[DoubleBuffer, Served]:
    """A DoubleBuffer over zeros shaped like `template` (version -1: no base), and its weights."""
    live = {k: torch.zeros_like(v) for k, v in template.items()}
    return DoubleBuffer(live, layout), lambda: {k: v.clone() for k, v in live.items()}


def node_reader(layout: Layout) -> tuple[SharedBuffer, SharedBufferReader, Served]:
    """A node buffer with one reader of its own, and what that reader sees of the newest version."""
    shared = SharedBuffer(layout, num_readers=1)
    reader = SharedBufferReader.attach(shared.name)

    def weights() -> dict[str, torch.Tensor]:
        if shared.version < 0:
            return {}
        reader.wait_for_version(shared.version, 10.0)
        return {k: v.clone() for k, v in reader.tensors().items()}

    return shared, reader, weights


def wire_reader(rank: int) -> tuple[Any, SharedBufferReader | None, Served]:
    """The ring and IPC tests' readers over `wire_workers`' engine layout: rank 1 a DoubleBuffer,
    rank 2 a node buffer (with its own reader, to close at the end)."""
    if rank == 1:
        consumer, weights = double_reader(ww.served(0), ww.engine_layout())
        return consumer, None, weights
    return node_reader(ww.engine_layout())


def corrupt_newest(shared: SharedBuffer, offset: int = 100, mask: int = 0xFF) -> None:
    """Flip bits of byte `offset` of the node buffer's newest slot (the base of the next delta)."""
    newest = shared._table.newest()  # the test reaches into the node buffer to corrupt its slot
    assert newest is not None
    shared._slots[newest][offset] ^= mask


def signal(path: str, text: str) -> None:
    """Write `text` to `path` atomically (a peer waits for the file to appear)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def wait_signal(path: str, what: str, timeout_s: float = 60.0) -> str:
    """The text of `path` once a peer wrote it, within `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} at {path}")
        time.sleep(0.01)
    with open(path) as fh:
        return fh.read()
