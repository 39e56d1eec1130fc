"""ConsistentHashRouter: stickiness, minimal remapping, bounded load."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.routing import ConsistentHashRouter, stable_hash

names = st.text(alphabet="abcdefghij0123456789-", min_size=1, max_size=8)
worker_sets = st.lists(names, min_size=2, max_size=12, unique=True)
key_lists = st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=60)


def homes(r: ConsistentHashRouter[str], keys: list[str]) -> dict[str, str]:
    """Where each key lands with nothing in flight (select then release)."""
    out = {}
    for k in keys:
        w = r.select(k)
        r.release(w)
        out[k] = w
    return out


def test_same_key_same_worker() -> None:
    r = ConsistentHashRouter([f"w{i}" for i in range(8)])
    keys = [f"env-{i}" for i in range(100)]
    first = homes(r, keys)
    assert homes(r, keys) == first
    assert {k: r.owner(k) for k in keys} == first
    assert len(set(first.values())) > 4  # spread over the workers
    # Another router over the same workers agrees: the ring does not depend on the object.
    assert homes(ConsistentHashRouter([f"w{i}" for i in range(8)]), keys) == first


def test_ring_is_the_same_in_another_process() -> None:
    """blake2b, not the per-process salted hash(): a fresh interpreter places keys identically."""
    code = (
        "from rlfleet.routing import ConsistentHashRouter\n"
        "r = ConsistentHashRouter([f'w{i}' for i in range(8)])\n"
        "print(','.join(r.owner(f'env-{i}') for i in range(50)))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    r = ConsistentHashRouter([f"w{i}" for i in range(8)])
    assert out.stdout.strip() == ",".join(str(r.owner(f"env-{i}")) for i in range(50))
    assert stable_hash("env-1") == stable_hash("env-1") != stable_hash("env-2")


@settings(max_examples=100, deadline=None)
@given(workers=worker_sets, keys=key_lists, victim=st.integers(min_value=0))
def test_only_the_removed_workers_keys_move(workers: list[str], keys: list[str], victim: int) -> None:
    r = ConsistentHashRouter(workers, vnodes=20)
    before = homes(r, keys)
    gone = workers[victim % len(workers)]
    r.remove_worker(gone)
    after = homes(r, keys)
    for k in keys:
        if before[k] != gone:
            assert after[k] == before[k], k
        else:
            assert after[k] != gone


@settings(max_examples=100, deadline=None)
@given(workers=worker_sets, keys=key_lists, new=names)
def test_a_new_worker_only_takes_keys(workers: list[str], keys: list[str], new: str) -> None:
    r = ConsistentHashRouter([w for w in workers if w != new], vnodes=20)
    before = homes(r, keys)
    r.add_worker(new)
    after = homes(r, keys)
    assert all(after[k] in (before[k], new) for k in keys)


@settings(max_examples=100, deadline=None)
@given(workers=worker_sets, keys=key_lists, victim=st.integers(min_value=0))
def test_draining_moves_only_that_workers_keys_and_undraining_restores_them(
    workers: list[str], keys: list[str], victim: int
) -> None:
    r = ConsistentHashRouter(workers, vnodes=20)
    before = homes(r, keys)
    drained = workers[victim % len(workers)]
    r.set_draining(drained, True)
    during = homes(r, keys)
    assert all(during[k] == before[k] for k in keys if before[k] != drained)
    assert drained not in during.values()
    r.set_draining(drained, False)
    assert homes(r, keys) == before


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=10),
    c=st.sampled_from([1.0, 1.1, 1.25, 2.0]),
    ops=st.lists(
        st.tuples(
            st.booleans(), st.sampled_from(["hot", "hot", "hot", "a", "b", "c"]), st.integers(0, 10**6)
        ),
        max_size=200,
    ),
)
def test_bounded_load_holds_at_every_placement(n: int, c: float, ops: list[tuple[bool, str, int]]) -> None:
    r = ConsistentHashRouter(range(n), load_factor=c, vnodes=10)
    held: list[int] = []
    for is_select, key, pick in ops:
        if is_select or not held:
            w = r.select(key)
            held.append(w)
            total = r.in_flight
            assert r.loads[w] <= math.ceil(c * total / n)
        else:
            r.release(held.pop(pick % len(held)))
    assert sum(r.loads.values()) == len(held)


def test_a_hot_key_spills_to_the_next_worker_then_comes_back() -> None:
    r = ConsistentHashRouter([f"w{i}" for i in range(4)], load_factor=1.25)
    home = r.owner("hot")
    out = r.assign(["hot"] * 40)
    assert out[0] == home
    assert len(set(out)) == 4  # bounded load spread the hot key
    assert max(r.loads.values()) <= math.ceil(1.25 * 40 / 4)
    for w in out:
        r.release(w)
    assert r.select("hot") == home


def test_no_key_goes_to_the_least_loaded() -> None:
    r = ConsistentHashRouter(["a", "b", "c"])
    assert r.assign(3) == ["a", "b", "c"]
    r.release("b")
    assert r.select() == "b"


def test_bound_and_parameters() -> None:
    r = ConsistentHashRouter(["a", "b"], load_factor=1.5)
    assert r.load_factor == 1.5
    assert r.bound() == math.ceil(1.5 * 1 / 2)
    r.assign(4)
    assert r.bound() == math.ceil(1.5 * 5 / 2)
    assert ConsistentHashRouter().bound() == 0
    assert ConsistentHashRouter().owner("k") is None
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="vnodes"):
            ConsistentHashRouter(vnodes=bad)
    for bad_c in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="load_factor"):
            ConsistentHashRouter(load_factor=bad_c)


def test_worker_id_controls_ring_positions() -> None:
    class Handle:
        def __init__(self, name: str) -> None:
            self.name = name

    hs = [Handle(f"actor-{i}") for i in range(5)]
    r = ConsistentHashRouter(hs, worker_id=lambda h: h.name)
    by_name = ConsistentHashRouter([h.name for h in hs])
    assert all(r.owner(k).name == by_name.owner(k) for k in map(str, range(50)))  # type: ignore[union-attr]
