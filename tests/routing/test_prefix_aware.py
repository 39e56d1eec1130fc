"""PrefixAwareRouter: longest cached prefix first, the load bound, versions, bounded memory."""

from __future__ import annotations

import contextlib
import gc
import random
import tracemalloc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlfleet.routing import (
    PREFIX_CACHE_ON_NEW_VERSION,
    NoWorkerAvailableError,
    PrefixAwareRouter,
    create_router,
)
from rlfleet.routing._prefix_tree import Block

SYSTEM = "You are a helpful assistant. " * 10  # 290 characters: 2 blocks of 128


def words(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    out = ""
    while len(out) < chars:
        out += rng.choice(["alpha ", "beta ", "gamma ", "delta ", f"{rng.randrange(10**6)} "])
    return out


def turn(r: PrefixAwareRouter[Any], prompt: object) -> Any:
    """Route one request and finish it at once."""
    worker = r.select(prompt)
    r.release(worker)
    return worker


def test_a_session_stays_where_its_prefix_is_cached() -> None:
    r = PrefixAwareRouter(["a", "b", "c", "d"])
    history = SYSTEM + words(1, 500)
    home = turn(r, history)
    for t in range(2, 8):  # every turn extends the conversation: it keeps its worker
        history += words(t, 300)
        assert turn(r, history) == home
    block = r.block_size[0]
    assert r.match(history) == {home: len(history) // block * block}
    # New sessions share only the system prompt: its holder takes them while under the load
    # bound, then they spread.
    assert turn(r, SYSTEM + words(99, 500)) == home
    others = [r.select(SYSTEM + words(100 + i, 500)) for i in range(8)]
    assert max(r.loads.values()) <= r.bound(0)
    assert len(set(others)) > 1


def test_the_longest_cached_prefix_wins() -> None:
    r = PrefixAwareRouter(["a", "b", "c"], block_size=8)
    base = "0123456789abcdef" * 8  # 128 characters, 16 blocks
    assert turn(r, base[:32]) == "a"  # a holds 4 blocks
    assert turn(r, base[:96]) == "a"  # the longest holder... a again, now 12 blocks
    r.set_draining("a", True)
    assert turn(r, base[:64]) in {"b", "c"}  # a is draining: the prompt goes elsewhere
    r.set_draining("a", False)
    held = r.match(base)
    assert held["a"] == 96
    assert sorted(held.values()) == [64, 96]
    assert turn(r, base) == "a"


def test_an_overloaded_holder_spills_to_the_least_loaded() -> None:
    r = PrefixAwareRouter(["a", "b", "c", "d"], load_factor=1.25)
    prompt = SYSTEM + words(7, 400)
    home = r.select(prompt)
    held = [home]
    for _ in range(6):
        held.append(r.select(prompt))
        loads = r.loads
        assert loads[home] <= r.bound(0)  # the holder never goes past the bound
    assert len(set(held)) > 1
    for w in held:
        r.release(w)
    assert turn(r, prompt) in set(held)  # back on a worker caching it once the load is gone


def test_token_ids_bytes_and_short_prompts() -> None:
    r = PrefixAwareRouter(["a", "b"])
    assert r.block_size == (128, 32)
    tokens = list(range(1000, 1100))  # 3 blocks of 32 token ids
    home = turn(r, tokens)
    assert turn(r, (*tokens, 7, 8, 9)) == home
    assert r.match(tokens) == {home: 96}
    assert turn(r, b"x" * 300) in {"a", "b"}
    assert turn(r, "short") in {"a", "b"}  # under one block: least-load, nothing cached
    assert r.match("short") == {}
    assert turn(r, None) in {"a", "b"}
    same = PrefixAwareRouter(["a", "b"], block_size=4)
    assert same.block_size == (4, 4)


def test_a_new_version_or_leaving_forgets_the_workers_cache() -> None:
    r = PrefixAwareRouter(["a", "b"], prefer_newest_version=False)
    prompt = SYSTEM + words(3, 600)
    home = turn(r, prompt)
    block = r.block_size[0]
    assert r.cached_blocks[home] == len(prompt) // block
    r.set_draining(home, True)  # draining keeps the cache: the worker still holds it
    assert r.match(prompt) == {home: len(prompt) // block * block}
    r.set_draining(home, False)
    r.set_version(home, 1)  # new weights: its KV cache is gone
    assert r.cached_blocks[home] == 0
    assert r.match(prompt) == {}
    assert r.tree_blocks == 0
    holder = turn(r, prompt)
    assert list(r.match(prompt)) == [holder]
    r.remove_worker(holder)
    assert r.tree_blocks == 0
    assert turn(r, prompt) == ({"a", "b"} - {holder}).pop()


def test_keep_holds_a_workers_cached_prefixes_across_versions() -> None:
    """Issue 28 #5: on_new_version="keep" (an engine that keeps its KV cache across weights)."""
    prompts = [SYSTEM + words(20 + i, 600) for i in range(12)]
    moved = {}
    for policy in ("forget", "keep"):
        r = PrefixAwareRouter(["a", "b", "c"], on_new_version=policy, prefer_newest_version=False)  # type: ignore[arg-type]
        assert r.on_new_version == policy
        home = {p: turn(r, p) for p in prompts}
        cached = r.cached_blocks
        for w in ("a", "b", "c"):  # a rolling update: every worker serves version 1
            r.set_draining(w, True)
            r.set_version(w, 1)
            r.set_draining(w, False)
        if policy == "keep":
            assert r.cached_blocks == cached
            assert all(home[p] in r.match(p) for p in prompts)
        else:
            assert r.cached_blocks == {"a": 0, "b": 0, "c": 0}
            assert r.match(prompts[0]) == {}
        moved[policy] = sum(turn(r, p + words(99, 50)) != home[p] for p in prompts)
    assert moved["keep"] == 0  # every session found its cache again
    assert PrefixAwareRouter().on_new_version == "forget"  # the default stays today's behaviour


def test_on_new_version_is_checked_and_reaches_create_router() -> None:
    for bad in ("drop", None, True):
        with pytest.raises(ValueError, match=r"on_new_version must be one of 'forget', 'keep', got"):
            PrefixAwareRouter(on_new_version=bad)  # type: ignore[arg-type]
    r = create_router("async", "prefix_aware", ["a"], on_new_version="keep")
    assert isinstance(r, PrefixAwareRouter)
    assert r.on_new_version == "keep"
    assert PREFIX_CACHE_ON_NEW_VERSION == ("forget", "keep")


def test_strict_versions_ignore_old_holders_and_sticky_ones_keep_them() -> None:
    prompt = SYSTEM + words(5, 600)
    for prefer, expect_home in (("strict", False), (True, True)):
        r = PrefixAwareRouter(["a", "b", "c"], prefer_newest_version=prefer)  # type: ignore[arg-type]
        home = turn(r, prompt)
        updated = "c" if home != "c" else "b"
        r.set_version(updated, 1)
        got = turn(r, prompt + words(6, 100))
        assert (got == home) is expect_home
        if not expect_home:
            assert got == updated


def test_bad_arguments_are_refused_clearly() -> None:
    r = PrefixAwareRouter(["a"])
    with pytest.raises(TypeError, match="prompt: a str, bytes or a sequence of token ids, got int"):
        r.select(42)
    assert r.in_flight == 0
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="block_size"):
            PrefixAwareRouter(block_size=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="max_blocks"):
            PrefixAwareRouter(max_blocks=bad)  # type: ignore[arg-type]


def _check_tree(r: PrefixAwareRouter[Any]) -> None:
    """Every block is held, holders are prefix-closed, counts match the tree and its bound."""
    counts: dict[Any, int] = {}
    nodes = 0
    stack: list[Block] = list(r._tree.root.children.values())
    while stack:
        block = stack.pop()
        nodes += 1
        assert block.holders, "a block nobody holds stayed in the tree"
        if block.parent is not None and block.parent is not r._tree.root:
            assert set(block.holders) <= set(block.parent.holders), "holders are not prefix-closed"
        for holder in block.holders:
            counts[holder.key] = counts.get(holder.key, 0) + 1
        stack.extend(block.children.values())
    assert nodes == r.tree_blocks
    cached = r.cached_blocks
    assert {w: n for w, n in cached.items() if n} == counts
    assert max(cached.values(), default=0) <= r.max_blocks
    for state in r._states.values():
        assert len(state.slot.queue) <= 2 * state.slot.count + 32


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from("sssssvrd"), st.integers(0, 7), st.text("ab", min_size=0, max_size=40)),
        max_size=80,
    ),
    max_blocks=st.integers(1, 12),
)
def test_tree_invariants_hold_under_any_sequence(ops: list[tuple[str, int, str]], max_blocks: int) -> None:
    r = PrefixAwareRouter(range(4), block_size=4, max_blocks=max_blocks, prefer_newest_version=False)
    version = 0
    for op, n, prompt in ops:
        w = n % 4
        if op == "s":
            with contextlib.suppress(NoWorkerAvailableError):  # every worker draining
                turn(r, prompt)
        elif op == "v":
            version += 1
            r.set_version(w, version)
        elif op == "d":
            r.set_draining(w, not r.is_draining(w))
        elif w in r:
            r.remove_worker(w)
            r.add_worker(w)
        _check_tree(r)


@pytest.mark.timeout(120)
def test_memory_stays_bounded_by_max_blocks() -> None:
    """Issue 18: bounded memory with LRU eviction, whatever the number of distinct prompts."""
    workers, max_blocks = 8, 64
    sessions = [SYSTEM + words(i, 1200) for i in range(200)]  # 11 blocks each
    fresh = [SYSTEM + words(10**6 + i, 1200) for i in range(6000)]
    gc.collect()
    tracemalloc.start()
    try:
        r = PrefixAwareRouter(range(workers), max_blocks=max_blocks)
        rng = random.Random(0)
        held: list[int] = []
        for i, prompt in enumerate(fresh):
            # Distinct prompts (evictions) and returning sessions (re-used blocks) mixed.
            turn(r, sessions[rng.randrange(len(sessions))] if i % 2 else prompt)
            assert max(r.cached_blocks.values()) <= max_blocks
            if i % 1000 == 999:
                gc.collect()
                held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    _check_tree(r)
    assert r.tree_blocks <= workers * max_blocks
    # 66,000 blocks routed; what the router keeps is its bounded tree: no growth after the
    # first thousand prompts filled it, and under 2 KiB per block it may hold (plus the
    # router's fixed tables).
    assert max(held) <= workers * max_blocks * 2048 + 256 * 1024, held
    assert held[-1] <= held[0] * 1.25, held
