"""What a newcomer meets first (issue 24 #10): `help()` lists every option with its default, and
arguments that would silently do the wrong thing are refused with an error that says why."""

from __future__ import annotations

import inspect
import pydoc
import re
from typing import Any

import pytest
from routing_helpers import ROUTER_FACTORIES, MakeRouter

from rlfleet.routing import (
    ConsistentHashRouter,
    LeastLoadRouter,
    NodeAffinityRouter,
    PowerOfTwoRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    Router,
    create_router,
)

ROUTER_CLASSES = [
    ConsistentHashRouter,
    LeastLoadRouter,
    NodeAffinityRouter,
    PowerOfTwoRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
]
COMMON = {"prefer_newest_version", "version_lag", "max_staleness", "max_in_flight", "load_factor"}


def _documented(cls: type) -> dict[str, str]:
    """`name -> default` of every `- name=default:` line `help(cls)` shows."""
    text = pydoc.plain(pydoc.render_doc(cls))
    return dict(re.findall(r"^\s*\|?\s*- (\w+)=([^:\s]+):", text, flags=re.M))


@pytest.mark.parametrize("cls", [Router, *ROUTER_CLASSES], ids=lambda c: c.__name__)
def test_help_lists_every_common_option_with_its_real_default(cls: type[Router[Any]]) -> None:
    documented = _documented(cls)
    assert set(documented) >= COMMON, f"help({cls.__name__}) misses {COMMON - set(documented)}"
    if cls is Router:
        return
    r = cls()  # the defaults as built
    for name in COMMON:
        assert documented[name] == repr(getattr(r, name)), name


@pytest.mark.parametrize("cls", ROUTER_CLASSES, ids=lambda c: c.__name__)
def test_help_lists_each_routers_own_options_with_their_defaults(cls: type[Router[Any]]) -> None:
    documented = _documented(cls)
    own = {
        p.name: p.default
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.kind is p.KEYWORD_ONLY
    }
    for name, default in own.items():
        shown = default.__name__ if callable(default) else repr(default)
        assert documented.get(name) == shown, f"help({cls.__name__}) shows {name}={documented.get(name)}"


@pytest.mark.parametrize("workers", ["abc", b"abc", bytearray(b"ab")], ids=["str", "bytes", "bytearray"])
def test_a_string_of_workers_is_refused_not_split_into_characters(
    make_router: MakeRouter, workers: object
) -> None:
    with pytest.raises(TypeError, match=r"workers must be an iterable of workers.*pass a list"):
        make_router(workers)
    with pytest.raises(TypeError, match="workers must be an iterable"):
        make_router(3)  # not iterable at all


def test_create_router_refuses_a_string_of_workers_too() -> None:
    for name in ("least_load", "prefix_aware", "consistent_hash"):
        with pytest.raises(TypeError, match="'abc'"):
            create_router("async", name, "abc")
        with pytest.raises(TypeError, match="'abc'"):
            create_router("sync", name, eval_policies="abc")
    assert create_router("async", "least_load", ["abc"]).workers == ["abc"]  # one worker named so


def test_assign_refuses_a_string_as_a_batch_of_keys(make_router: MakeRouter) -> None:
    r = make_router(["a", "b"])
    with pytest.raises(TypeError, match="keys must be an iterable of keys"):
        r.assign("env-1")
    assert r.in_flight == 0
    assert len(r.assign(["env-1"])) == 1


def test_every_router_in_the_tests_is_checked() -> None:
    assert len(ROUTER_FACTORIES) == len(ROUTER_CLASSES)
