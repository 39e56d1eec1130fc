"""Public names say where users import them from.

`help(LeastLoadRouter)`, tracebacks and reprs name `rlfleet.routing`, the one import path users
write, not the private module a name happens to be defined in (pickle finds it there too). The
price, as for numpy's public names: `inspect.getsource` of a marked *class* looks in
`rlfleet/routing/__init__.py` and fails (functions keep their file); the face's imports say
which `_`-module defines each name.
"""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")

HOME = "rlfleet.routing"


def public(obj: T) -> T:
    """Mark `obj` (a class or function re-exported by `rlfleet.routing`) as living there."""
    obj.__module__ = HOME  # only classes and functions are marked
    return obj
