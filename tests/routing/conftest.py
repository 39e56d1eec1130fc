"""Fixtures for the routing suite."""

from __future__ import annotations

import pytest
from routing_helpers import ROUTER_FACTORIES, MakeRouter


@pytest.fixture(params=sorted(ROUTER_FACTORIES))
def make_router(request: pytest.FixtureRequest) -> MakeRouter:
    """Each router class, built over the given workers with the given options."""
    return ROUTER_FACTORIES[request.param]
