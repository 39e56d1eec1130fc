"""The process harness of the refit tests: spawned bodies report once through a queue, then leave.

A body reports ``(key, "ok", result)`` or ``(key, "error", traceback)`` and exits at once with
``os._exit`` (a half-torn group can stall a normal exit); `collect` gathers the reports.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Hashable
from typing import Any


def report(queue: Any, key: Hashable, body: Callable[[], Any]) -> None:
    """Run `body`, put its result (or its traceback) under `key`, and end the process."""
    try:
        queue.put((key, "ok", body()))
    except BaseException as exc:
        queue.put((key, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    leave(queue)


def leave(queue: Any) -> None:
    """Flush the queue and exit now."""
    queue.close()
    queue.join_thread()
    os._exit(0)


def collect(
    procs: list[Any],
    queue: Any,
    expected: int,
    timeout: float,
    on_report: Callable[[Hashable], None] | None = None,
) -> dict[Any, Any]:
    """Start `procs`, gather `expected` reports (a failed body raises), then reap every process.

    `on_report(key)` may append and start more processes (they are reaped too).
    """
    for p in procs:
        p.start()
    results: dict[Any, Any] = {}
    end = time.monotonic() + timeout
    try:
        while len(results) < expected and time.monotonic() < end:
            try:
                key, status, value = queue.get(timeout=0.5)
            except Exception:
                continue
            if status != "ok":
                raise AssertionError(f"{key} failed:\n{value}")
            results[key] = value
            if on_report is not None:
                on_report(key)
    finally:
        for p in procs:
            p.join(timeout=max(0.1, end - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
    if len(results) < expected:
        raise AssertionError(f"only {sorted(results, key=str)} returned within {timeout}s")
    return results
