"""Fixtures every suite may use (see `testkit`): nothing heavy is imported here."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import testkit


@pytest.fixture(scope="session")
def cluster() -> Iterator[Any]:
    """A 3-node Ray cluster on this machine for the whole suite (`testkit.ray_cluster`).

    Test modules whose workers are defined outside an installed package register those modules
    with ``ray.cloudpickle.register_pickle_by_value`` when they are imported.
    """
    pytest.importorskip("ray")
    with testkit.ray_cluster(3) as c:
        yield c
