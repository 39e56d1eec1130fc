"""Checkpoints of a worker: written whole or not at all, in the caller's thread or in the background.

A checkpoint goes to a temporary file that is renamed over `path` once written, so a reader
never finds half of one. A background write (`async_save`) reports its failure at the next
`finalize` (NeMo RL's `finalize_async_save`), which every later save and the shutdown call.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

import torch


def _write(state: Mapping[str, Any], path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(dict(state), tmp)
    os.replace(tmp, path)


class Checkpoints:
    """Save and load one worker's checkpoints; at most one background write at a time."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: Mapping[str, Any], path: str, async_save: bool = False) -> str:
        """Write `state` (tensors, plain data) to `path`; with `async_save` in a background thread."""
        self.finalize()
        if not async_save:
            _write(state, path)
            return path

        def run() -> None:
            try:
                _write(state, path)
            except BaseException as exc:  # surfaced by finalize
                self._error = exc

        self._thread = threading.Thread(target=run, name="rlfleet-async-save", daemon=True)
        self._thread.start()
        return path

    @staticmethod
    def load(path: str) -> dict[str, Any]:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
        return state

    def finalize(self, timeout: float = 600.0) -> None:
        """Wait (up to `timeout`) for a background write; raise if it failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._thread = thread
                raise TimeoutError(f"async checkpoint still writing after {timeout:.1f}s")
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"async checkpoint failed: {error}") from error
