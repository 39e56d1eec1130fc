"""LeastLoadRouter and the seed-compatible least_load_assign."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.routing import LeastLoadRouter, NoWorkerAvailableError, least_load_assign


def seed_assign(current_loads: list[int], num_tasks: int) -> list[int]:
    """A transcription of the seed's async SimpleRouter.assign (rlightning utils/router.py)."""
    heap = [(int(current_loads[i]), i) for i in range(len(current_loads))]
    if not heap:
        raise ValueError("No policies available for routing")
    heapq.heapify(heap)
    assignments: list[int] = []
    for _ in range(num_tasks):
        load, idx = heapq.heappop(heap)
        assignments.append(idx)
        heapq.heappush(heap, (load + 1, idx))
    return assignments


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(min_value=-5, max_value=50), min_size=1, max_size=40),
    num_tasks=st.integers(min_value=0, max_value=200),
)
def test_least_load_assign_matches_the_seed_heap(loads: list[int], num_tasks: int) -> None:
    assert least_load_assign(loads, num_tasks) == seed_assign(loads, num_tasks)


def test_least_load_assign_edges() -> None:
    assert least_load_assign([3, 1, 1], 4) == [1, 2, 1, 2]
    assert least_load_assign([2.0, 0.0], 2) == [1, 1]  # the seed casts loads with int()
    assert least_load_assign([], 0) == []
    with pytest.raises(NoWorkerAvailableError, match="empty"):
        least_load_assign([], 1)
    with pytest.raises(ValueError, match="-1"):
        least_load_assign([0], -1)
    with pytest.raises(TypeError, match="num_tasks"):
        least_load_assign([0], 1.0)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=12),
    ops=st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=10**6)), max_size=120),
    batch=st.integers(min_value=0, max_value=40),
)
def test_router_decides_like_the_seed_heap_on_its_own_counts(
    n: int, ops: list[tuple[bool, int]], batch: int
) -> None:
    r = LeastLoadRouter(range(n))
    held: list[int] = []
    for is_select, pick in ops:
        if is_select or not held:
            before = r.loads()
            w = r.select()
            # The least loaded, lowest index among the ties.
            assert (before[w], w) == min((load, i) for i, load in before.items())
            held.append(w)
        else:
            r.release(held.pop(pick % len(held)))
    loads = r.loads()
    expect = least_load_assign([loads[i] for i in range(n)], batch)
    assert r.assign(batch) == expect
    assert r.in_flight == len(held) + batch


def test_ties_go_to_the_first_added_worker() -> None:
    r = LeastLoadRouter(["z", "y", "x"])
    assert r.assign(5) == ["z", "y", "x", "z", "y"]
    r.release("y")
    assert r.select() == "y"


def test_stale_heap_entries_stay_bounded() -> None:
    n = 16
    r = LeastLoadRouter(range(n))
    held = r.assign(n * 3)
    for i in range(20_000):
        w = held.pop(i % len(held))
        r.release(w)
        held.append(r.select())
    (heap,) = r._heap.heaps.values()
    assert len(heap) <= 2 * n + 33
    assert sum(r.loads().values()) == len(held)
