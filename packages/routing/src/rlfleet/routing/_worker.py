"""One worker's routing state, the options every router takes, and the argument checks they share."""

from __future__ import annotations

import itertools
import math
import numbers
import time
import warnings
from collections.abc import Hashable
from typing import Any, Generic, Literal, TypeVar

from typing_extensions import TypedDict

from rlfleet.routing._public import public

W = TypeVar("W", bound=Hashable)

# True: newest version first within the load bound, a keyed request keeps its worker (sticky);
# "strict": only the newest version while one of its workers can take the request; False: ignore.
VersionPreference = bool | Literal["strict"]

# Stamps for rotating ties (LoadHeap tickets, `picked`): one counter for every router; `next` on
# an itertools.count is atomic, so routers with per-node locks can share it.
next_ticket = itertools.count().__next__

# The longest single wait: a longer timeout is waited out in waits of this length (the OS and
# asyncio refuse waits beyond about 292 years; threading.TIMEOUT_MAX is 9.2e9 s on Linux).
LONGEST_WAIT = 86_400.0


# The options every router takes, as each router's docstring lists them (help() shows them).
COMMON_OPTIONS = """
    Options every router takes (keywords):
    - prefer_newest_version=True: how weight versions steer requests during a rolling update
      (True: newest first up to the load bound, sticky keys keep a recent worker; "strict":
      newest only while one of its workers can take the request; False: ignore versions).
    - version_lag=1: versions behind the newest that still count as recent.
    - max_staleness=None: never hand a request to a worker more than this many versions behind
      the latest committed version (`set_latest_version`, or the newest any worker serves);
      None: unbounded. With none eligible, `select(timeout=...)` waits.
    - max_in_flight=None: most requests one worker may hold (None: no cap).
    - load_factor=1.25: the load bound, `ceil(load_factor * (in_flight + 1) / candidates)`.
"""


R = TypeVar("R", bound=type)


def public_router(cls: R) -> R:
    """A router class users import from `rlfleet.routing`: its docstring (what `help()` shows)
    ends with the options every router takes, with their defaults."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + COMMON_OPTIONS
    return public(cls)


@public
class RouterOptions(TypedDict, total=False):
    """Keyword options every router takes (see `Router`)."""

    prefer_newest_version: VersionPreference
    max_in_flight: int | None
    load_factor: float
    version_lag: int
    max_staleness: int | None


class WorkerState(Generic[W]):
    """One worker's state. Guarded by the router's lock (by its node's lock in NodeAffinityRouter)."""

    __slots__ = (
        "active",
        "draining",
        "group",
        "index",
        "key",
        "load",
        "node",
        "picked",
        "selectable",
        "slot",
        "stale",
        "ticket",
        "version",
    )

    def __init__(self, key: W, index: int, node: Hashable | None, version: int) -> None:
        self.key = key
        self.index = index  # insertion order: ring and round-robin order
        self.node = node
        self.version = version
        self.load = 0  # requests in flight
        self.draining = False
        self.active = True  # False once removed (kept only while requests are still in flight)
        self.stale = False  # more than max_staleness versions behind the latest committed version
        self.selectable = False  # active, not draining, not stale: in the subclass's index
        self.group = 0  # candidate group: the version when versions matter, else 0
        self.ticket = -1  # its live entry in a LoadHeap (-1: none)
        self.picked = -1  # when it was last picked: ties go to the one picked longest ago
        self.slot: Any = None  # subclass-private (NodeAffinityRouter: the node; prefix: its blocks)


@public
class Loads(dict[W, int]):
    """Requests in flight per worker, one consistent snapshot.

    `loads` used to be a method: calling the snapshot still returns it, with a warning.
    """

    def __call__(self) -> Loads[W]:
        warnings.warn("Router.loads is a property: write router.loads", DeprecationWarning, stacklevel=2)
        return self


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"version must be an int, got {version!r}")
    return version


def check_many(items: object, what: str, things: str) -> None:
    """Refuse a str or bytes where an iterable of `things` is expected (it would iterate
    character by character: `LeastLoadRouter("abc")` is not three workers 'a', 'b', 'c')."""
    if isinstance(items, (str, bytes, bytearray)):
        raise TypeError(
            f"{what}: {things} must be an iterable of {things}, got the {type(items).__name__} "
            f"{items!r}; for a single one pass a list: [{items!r}]"
        )
    try:
        iter(items)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"{what}: {things} must be an iterable of {things}, got {items!r}") from None


class Options:
    """`RouterOptions`, validated, with their defaults."""

    __slots__ = ("cap", "factor", "lag", "prefer", "staleness")

    def __init__(self, options: RouterOptions) -> None:
        unknown = set(options) - set(RouterOptions.__annotations__)
        if unknown:
            raise TypeError(f"unknown router option(s): {', '.join(sorted(unknown))}")
        prefer = options.get("prefer_newest_version", True)
        if not isinstance(prefer, (bool, str)) or prefer not in (True, False, "strict"):
            raise ValueError(f"prefer_newest_version must be True, False or 'strict', got {prefer!r}")
        cap = options.get("max_in_flight")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise ValueError(f"max_in_flight must be a positive int or None, got {cap!r}")
        factor = options.get("load_factor", 1.25)
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1.0 <= factor < math.inf:
            raise ValueError(f"load_factor must be a finite number >= 1, got {factor!r}")
        lag = options.get("version_lag", 1)
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 0:
            raise ValueError(f"version_lag must be an int >= 0, got {lag!r}")
        staleness = options.get("max_staleness")
        if staleness is not None and (
            isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0
        ):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {staleness!r}")
        self.prefer: VersionPreference = prefer
        self.cap: int | None = cap
        self.factor = float(factor)
        self.lag = lag
        self.staleness: int | None = staleness


def deadline(timeout: object, what: str) -> float | None:
    """Monotonic deadline `timeout` seconds from now (None: no waiting).

    A negative timeout means "do not wait". Infinity is refused: every blocking call has a
    deadline, and a very long finite one (1e10 s) is waited out in `LONGEST_WAIT` steps.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{what}: timeout must be a number of seconds, got {timeout!r}")
    seconds = float(timeout)
    if math.isnan(seconds) or seconds == math.inf:
        raise ValueError(
            f"{what}: timeout must be a finite number of seconds, got {seconds}; every blocking "
            "call has a deadline (pass a large number to wait long)"
        )
    return time.monotonic() + max(0.0, seconds)
