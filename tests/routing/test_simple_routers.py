"""RoundRobinRouter and PowerOfTwoRouter."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.routing import PowerOfTwoRouter, RoundRobinRouter


def test_round_robin_cycles_in_insertion_order() -> None:
    r = RoundRobinRouter(["a", "b", "c"])
    assert r.assign(7) == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_skips_draining_and_full_workers() -> None:
    r = RoundRobinRouter(["a", "b", "c"], max_in_flight=2)
    r.set_draining("b", True)
    assert r.assign(4) == ["a", "c", "a", "c"]
    r.set_draining("b", False)
    assert r.assign(2) == ["b", "b"]


def test_round_robin_follows_membership_changes() -> None:
    r = RoundRobinRouter(["a", "b"])
    assert r.assign(3) == ["a", "b", "a"]
    r.add_worker("c")
    r.remove_worker("a")
    out = r.assign(4)
    assert sorted(out) == ["b", "b", "c", "c"]
    assert out[0] != out[1]
    assert out[:2] == out[2:]


def test_power_of_two_is_reproducible_with_a_seed() -> None:
    a = PowerOfTwoRouter(range(50), seed=7)
    b = PowerOfTwoRouter(range(50), seed=7)
    assert a.assign(500) == b.assign(500)


@settings(max_examples=100, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=2**32),
    ops=st.lists(st.tuples(st.booleans(), st.integers(min_value=0, max_value=10**6)), max_size=150),
)
def test_power_of_two_with_two_workers_always_takes_the_less_loaded(
    seed: int, ops: list[tuple[bool, int]]
) -> None:
    r = PowerOfTwoRouter(["a", "b"], seed=seed)
    held: list[str] = []
    for is_select, pick in ops:
        if is_select or not held:
            before = r.loads
            w = r.select()
            other = "b" if w == "a" else "a"
            assert before[w] <= before[other]
            held.append(w)
        else:
            r.release(held.pop(pick % len(held)))
    assert sum(r.loads.values()) == len(held)


def test_power_of_two_balances_better_than_the_worst_case() -> None:
    r = PowerOfTwoRouter(range(64), seed=0)
    r.assign(64 * 20)
    loads = r.loads.values()
    # Two choices keep the maximum within ~log log n of the mean (deterministic under the seed).
    assert max(loads) <= 20 + 3


def test_power_of_two_finds_the_last_free_worker() -> None:
    r = PowerOfTwoRouter(range(10), seed=3, max_in_flight=1)
    assert sorted(r.assign(10)) == list(range(10))
