"""rlfleet.routing: Routers that pick which rollout (eval) worker serves a request: least-load, round-robin, power-of-two, node-affinity, consistent-hash, weight-version aware."""

from rlfleet.routing.__about__ import __version__

__all__ = ["__version__"]
