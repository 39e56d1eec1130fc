"""`public`: a name exported by the package root reports the root as its module.

``help(plan_sync)`` and tracebacks then name ``rlfleet.placement``, the one import path users
write, not the private module (and family folder) that happens to define it; pickling still
finds the object there, since the root exports it under the same name.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["PACKAGE", "public"]

PACKAGE = "rlfleet.placement"

T = TypeVar("T")


def public(obj: T) -> T:
    """Mark a class or function exported by the package root (its ``__module__`` becomes the root)."""
    obj.__module__ = PACKAGE
    return obj
