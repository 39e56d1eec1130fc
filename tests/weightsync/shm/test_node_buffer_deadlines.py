"""Deadlines reach the node buffer: a writer waiting for a reader that does not refresh waits no
longer than the sync that called it (a broadcast, several senders' shares, `feed`) or its own
`timeout_s`, names that reader when it gives up, and never holds other publishes past theirs."""

from __future__ import annotations

import inspect
import re
import threading
from typing import Any

import deadline_workers as dw
import pytest
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    DEFAULT_RING_TIMEOUT_S,
    SharedBuffer,
    SharedBufferReader,
    ShmRingReceiver,
    ShmRingSender,
    SyncTimeoutError,
    checksum,
    feed,
)


def _names_the_reader(message: str) -> bool:
    return "reader 0" in message and "must refresh()" in message


def _deadline_of(message: str) -> float:
    """The deadline a SyncTimeoutError says it waited under."""
    found = re.search(r"\(deadline ([0-9.]+)s\)", message)
    assert found is not None, message
    return float(found.group(1))


@pytest.mark.timeout(200)
def test_a_receive_waits_for_a_lingering_reader_under_its_own_deadline_and_names_it() -> None:
    """`receive(node_buffer, deadline=2)` from one sender, and from two (a SharesReceiver), gives
    up at the sync's 2 s (not the buffer's 600 s, and not once per sender), naming the reader."""
    results = w.run_ranks(dw.scenario_lingering_reader, 3, timeout=180.0)
    node = results[dw.RECEIVER]
    for label in ("alone", "shares"):
        got = node[label]
        assert got["type"] == "SyncTimeoutError", (label, got)
        assert _names_the_reader(got["message"]), got["message"]
        assert _deadline_of(got["message"]) <= dw.SYNC_DEADLINE, got["message"]  # not the buffer's 600 s
    assert node["node_version"] == 2  # nothing of versions 3 or 4 committed
    assert not results[0]["alone"]["ok"]
    for sender in (0, 1):
        assert not results[sender]["shares"]["ok"], results[sender]["shares"]  # every sender is told
        assert results[sender]["after"]["ok"], results[sender]["after"]
    assert node["after"]["ok"], node["after"]
    assert node["checksum"] == checksum(w.make_state(5))


def _lingering(layout: Any, timeout_s: float | None) -> tuple[SharedBuffer, SharedBufferReader]:
    """A node buffer whose one reader stays on version 1 while version 2 is the newest."""
    node = SharedBuffer(layout, 1, timeout_s=timeout_s)
    node.publish(w.make_state(1), 1, 30.0)
    reader = SharedBufferReader.attach(node.name)
    reader.refresh(30.0)
    node.publish(w.make_state(2), 2, 30.0)
    return node, reader


@pytest.mark.timeout(120)
def test_feed_with_its_default_deadline_gives_up_at_the_node_buffers_timeout() -> None:
    layout = w.layout_of(w.make_state(0))
    node, reader = _lingering(layout, 1.5)
    try:
        with pytest.raises(SyncTimeoutError) as info:
            feed(node, w.make_state(3).items(), 3)
        assert _names_the_reader(str(info.value)), info.value
        assert _deadline_of(str(info.value)) == 1.5, info.value
        assert node.latest_version() == 2
        reader.refresh(30.0)
        assert feed(node, w.make_state(3).items(), 3) == 3  # the reader left: it goes through
    finally:
        reader.close()
        node.close()


class _Announcing(SharedBuffer):
    """A node buffer that says when a version starts claiming its slot (`_begin`, the wait)."""

    claiming = threading.Event()

    def _begin(self, version: int) -> None:
        self.claiming.set()
        super()._begin(version)


@pytest.mark.timeout(120)
def test_a_publish_waiting_behind_another_gives_up_at_its_own_deadline() -> None:
    """A feed waits (up to 30 s) for the lingering reader; a publish on the same buffer meanwhile
    gives up at its own 1 s, naming what holds the buffer, instead of waiting behind the feed."""
    layout = w.layout_of(w.make_state(0))
    node = _Announcing(layout, 1, timeout_s=None)
    node.publish(w.make_state(1), 1, 30.0)
    reader = SharedBufferReader.attach(node.name)
    reader.refresh(30.0)
    node.publish(w.make_state(2), 2, 30.0)
    node.claiming.clear()
    result: dict[str, Any] = {}
    feeder = threading.Thread(
        target=lambda: result.update(feed=w.outcome(lambda: feed(node, w.make_state(3).items(), 3, 30.0)))
    )
    try:
        feeder.start()
        assert node.claiming.wait(30.0)  # the feed waits for the reader from here
        with pytest.raises(SyncTimeoutError) as info:
            node.publish(w.make_state(4), 4, 1.0)
        assert _deadline_of(str(info.value)) == 1.0, info.value
        assert "version 3" in str(info.value), info.value  # what holds the buffer
        assert feeder.is_alive(), "the publish gave up only once the feed did"
        reader.refresh(30.0)
        feeder.join(60.0)
        assert result["feed"]["ok"], result["feed"]
        assert node.latest_version() == 3
    finally:
        reader.close()
        node.close()


def test_ring_deadlines_default_to_a_named_finite_constant() -> None:
    """ShmRing's send and receive wait `DEFAULT_RING_TIMEOUT_S` (60 s) by default: their
    signatures say so (they said None, which elsewhere means no limit)."""
    for method in (ShmRingSender.send, ShmRingReceiver.receive):
        assert inspect.signature(method).parameters["deadline"].default == DEFAULT_RING_TIMEOUT_S
    assert DEFAULT_RING_TIMEOUT_S == 60.0
