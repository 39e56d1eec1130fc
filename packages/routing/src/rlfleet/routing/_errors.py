"""Errors a router raises.

Every routing failure is a `RoutingError`; the subclass says what went wrong. The extra
builtin base (`LookupError`, `ValueError`, `TimeoutError`) lets callers that only know the
builtins still catch the right thing.
"""

from __future__ import annotations

from rlfleet.routing._public import public


@public
class RoutingError(RuntimeError):
    """Base class of every error raised by rlfleet.routing."""


@public
class NoWorkerAvailableError(RoutingError):
    """No worker can take the request (none added, all draining, all at capacity).

    Raised at once when `select` gets no timeout, or after the timeout ran out.
    """


@public
class UnknownWorkerError(RoutingError, LookupError):
    """The worker was never added to this router (or has been removed)."""


@public
class NotInFlightError(RoutingError, ValueError):
    """`release` on a worker that has no request in flight: counts never go negative."""


@public
class DuplicateWorkerError(RoutingError, ValueError):
    """`add_worker` on a worker the router already holds."""


@public
class DrainTimeoutError(RoutingError, TimeoutError):
    """`wait_drained` ran out of time with requests still in flight on the worker."""
