"""Termination signals: what a process must not leave behind when SIGTERM or SIGHUP ends it.

Shared-memory segments a process created (`_shm` adds their unlinking first) and anything else
registered here (private directories, sockets) are cleaned up from a signal handler chained
before the one that was there, so a SIGTERMed process leaves no trace; a SIGKILLed one cannot,
and leaves its resources to the next process that finds their creator dead.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

__all__ = [
    "TERMINATION_SIGNALS",
    "add_cleanup",
    "install_termination_cleanup",
    "register_termination_cleanup",
]

TERMINATION_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
_chained: dict[int, Any] = {}  # signal -> the handler ours replaced (called first)
_cleanups: list[Callable[[], None]] = []  # in order: segments first, then the rest


def add_cleanup(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run `cleanup` when a termination signal ends this process (no handler installed yet);
    returns a function that removes it."""
    _cleanups.append(cleanup)
    return functools.partial(_remove, cleanup)


def _remove(cleanup: Callable[[], None]) -> None:
    with contextlib.suppress(ValueError):
        _cleanups.remove(cleanup)


def register_termination_cleanup(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run `cleanup` (idempotent, quick) if SIGTERM or SIGHUP ends this process, after its
    segments are unlinked (`install_termination_cleanup`); returns a function that unregisters it."""
    remove = add_cleanup(cleanup)
    install_termination_cleanup()
    return remove


def _run_cleanups() -> None:
    for cleanup in list(_cleanups):
        with contextlib.suppress(Exception):
            cleanup()


def _on_termination(signum: int, frame: FrameType | None) -> None:
    previous = _chained.get(signum, signal.SIG_DFL)
    if callable(previous):
        try:
            previous(signum, frame)
        except BaseException:  # it ends the process (SystemExit, KeyboardInterrupt, ...)
            _run_cleanups()
            raise
        return  # it chose to carry on: the process keeps its segments
    _run_cleanups()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as without us


def install_termination_cleanup() -> list[int]:
    """Unlink this process's segments when SIGTERM or SIGHUP terminates it; returns the signals covered.

    Called by `SharedSegment.create` (so a creator needs nothing else). Only the main thread
    may install signal handlers: from another thread this does nothing (call it once from the
    main thread, e.g. at start-up). A handler that was there before is called first: if it
    raises (``sys.exit``), the segments are unlinked and the exception goes on; if it returns,
    the process carries on and keeps them. With the default action the segments are unlinked
    and the process then dies of the signal as before. Ignored signals, and handlers installed
    outside Python, are left alone. Installed once per process.
    """
    if threading.current_thread() is not threading.main_thread():
        return sorted(_chained)
    for sig in TERMINATION_SIGNALS:
        if sig in _chained:
            continue
        current = signal.getsignal(sig)
        if current is signal.SIG_IGN or current is None:
            continue
        try:
            signal.signal(sig, _on_termination)
        except (ValueError, OSError):  # pragma: no cover - a sub-interpreter
            continue
        _chained[sig] = current
    return sorted(_chained)
