"""Assembly and RecordingConsumer in one process: shares checked, a version committed only when
every sender's share arrived, an abort of any part keeps the previous version. (The same over
real gloo, with a sender killed mid-version, is in test_commit_protocol.py.)"""

from __future__ import annotations

import threading

import pytest
import shm_workers as w
import torch

from rlfleet.weightsync import (
    Assembly,
    BucketConsumer,
    BucketTarget,
    DeferredCommit,
    DiscardingConsumer,
    DoubleBuffer,
    IncompleteSyncError,
    Layout,
    MetadataError,
    RecordingConsumer,
    SyncAbortedError,
    TensorTarget,
    TimedConsumer,
    VersionError,
    checksum,
    pack_bucket,
)
from rlfleet.weightsync.buffers import ExpectedVersion
from rlfleet.weightsync.codec import holds_base, pack_base

BUCKET = 8 * 1024


def _layout() -> Layout:
    return w.layout_of(w.make_state(1), BUCKET)


def _halves(layout: Layout) -> dict[str, list[int]]:
    half = len(layout.buckets) // 2
    return {"a": list(range(half)), "b": list(range(half, len(layout.buckets)))}


def _feed(consumer: BucketConsumer, state: dict[str, torch.Tensor], indices: list[int]) -> None:
    layout = consumer.layout
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    for i in indices:
        consumer.consume(i, pack_bucket(layout, i, state, scratch).clone())


@pytest.mark.parametrize(
    ("shares", "words"),
    [
        ({}, "at least one sender"),
        ({"a": [0, 1], "b": [1]}, "in the shares of both 'a' and 'b'"),
        ({"a": [0]}, "to no sender"),
        ({"a": [999]}, "not a bucket"),
        ({"": [0]}, "non-empty strings"),
    ],
)
def test_shares_must_be_disjoint_and_cover_the_layout(shares: dict[str, list[int]], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Assembly(RecordingConsumer(_layout()), shares)


def test_two_parts_from_two_threads_commit_one_version_bit_exact() -> None:
    layout = _layout()
    shares = _halves(layout)
    inner = DoubleBuffer(w.zeros_like_layout(layout), layout)
    assembly = Assembly(inner, shares)
    state = w.make_state(1)

    def sender(name: str) -> None:
        part = assembly.part(name)
        part.begin(1)
        _feed(part, state, shares[name])
        part.prepare_commit(1, 10.0)  # waits for the other part's buckets
        part.commit(1)

    threads = [threading.Thread(target=sender, args=(s,)) for s in shares]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert inner.version == 1
    assert assembly.version == 1
    assert checksum(inner.live) == checksum(state)
    assembly.commit(1)  # already applied: a no-op


def test_a_missing_bucket_is_an_incomplete_sync_naming_the_sender() -> None:
    layout = _layout()
    shares = _halves(layout)
    inner = RecordingConsumer(layout)
    assembly = Assembly(inner, shares)
    state = w.make_state(1)
    for name in shares:
        assembly.part(name).begin(1)
    _feed(assembly.part("a"), state, shares["a"])
    _feed(assembly.part("b"), state, shares["b"][:-1])
    with pytest.raises(IncompleteSyncError, match=rf"sender 'b' is missing buckets \[{shares['b'][-1]}\]"):
        assembly.commit(1)
    assert inner.version == -1
    assert inner.aborts  # the inner consumer dropped the version
    with pytest.raises(SyncAbortedError, match="sender 'b'"):  # and every part now refuses it
        assembly.part("a").prepare_commit(1, 1.0)


def test_a_part_that_times_out_waiting_names_the_late_sender() -> None:
    layout = _layout()
    shares = _halves(layout)
    assembly = Assembly(RecordingConsumer(layout), shares)
    part = assembly.part("a")
    part.begin(1)
    _feed(part, w.make_state(1), shares["a"])
    with pytest.raises(IncompleteSyncError, match="sender 'b'"):
        part.prepare_commit(1, 0.2)


def test_an_abort_of_one_part_keeps_the_previous_version() -> None:
    layout = _layout()
    shares = _halves(layout)
    inner = DoubleBuffer(w.zeros_like_layout(layout), layout)
    assembly = Assembly(inner, shares)
    for version in (1, 2):
        for name in shares:
            part = assembly.part(name)
            part.begin(version)
            _feed(part, w.make_state(version), shares[name])
        if version == 2:
            assembly.part("b").abort(RuntimeError("sender b died"))
            with pytest.raises(SyncAbortedError, match="sender 'b'"):
                assembly.part("a").prepare_commit(2, 1.0)
            break
        for name in shares:
            assembly.part(name).prepare_commit(version, 5.0)
        for name in shares:
            assembly.part(name).commit(version)
    assert inner.version == 1
    assert checksum(inner.live) == checksum(w.make_state(1))
    with pytest.raises(SyncAbortedError):
        assembly.part("a").begin(2)  # the failed version stays failed
    for name in shares:  # the next version goes through
        part = assembly.part(name)
        part.begin(3)
        _feed(part, w.make_state(3), shares[name])
    assembly.prepare_commit(3, 5.0)
    assembly.commit(3)
    assert checksum(inner.live) == checksum(w.make_state(3))


def test_a_part_takes_only_its_own_share_and_forwards_landing_zones() -> None:
    layout = _layout()
    shares = _halves(layout)
    inner = RecordingConsumer(layout, bucket_targets=True)
    assembly = Assembly(inner, shares)
    part = assembly.part("a")
    assert isinstance(part, BucketConsumer)
    assert isinstance(part, BucketTarget)
    assert isinstance(part, TensorTarget)
    part.begin(1)
    assert part.bucket_target(shares["a"][0]) is not None
    assert part.bucket_target(shares["b"][0]) is None  # not its share
    with pytest.raises(MetadataError, match="not in sender 'a'"):
        _feed(part, w.make_state(1), [shares["b"][0]])
    with pytest.raises(VersionError):
        part.prepare_commit(7, 1.0)
    with pytest.raises(ValueError, match="no share"):
        assembly.part("c")


def test_recording_consumer_records_and_fails_on_request() -> None:
    layout = _layout()
    consumer = RecordingConsumer(layout)
    state = w.make_state(1)
    consumer.begin(1)
    _feed(consumer, state, [b.index for b in layout.buckets])
    consumer.prepare_commit(1)
    consumer.commit(1)
    assert consumer.methods()[0] == "begin"
    assert consumer.methods()[-2:] == ["prepare_commit", "commit"]
    assert checksum(consumer.weights) == checksum(state)
    consumer.fail_on = 0
    consumer.begin(2)
    with pytest.raises(RuntimeError, match="injected"):
        _feed(consumer, w.make_state(2), [0])
    consumer.abort(RuntimeError("transport"))
    assert consumer.aborts == ["RuntimeError: transport"]
    assert consumer.version == 1
    with pytest.raises(VersionError):
        consumer.begin(1)


@pytest.mark.parametrize("first", ["a", "b"])
def test_parts_that_announce_different_versions_fail_it_and_nothing_commits(first: str) -> None:
    """Every share of one version carries that version: a part announcing another one is refused
    (naming both senders), the part already in the version fails too, and nothing commits."""
    layout = _layout()
    shares = _halves(layout)
    inner = DoubleBuffer(w.zeros_like_layout(layout), layout)
    assembly = Assembly(inner, shares)
    second = "b" if first == "a" else "a"
    versions = {first: 5, second: 6}
    assembly.part(first).begin(versions[first])
    words = rf"sender '{second}' announces version {versions[second]}"
    with pytest.raises(VersionError, match=words) as info:
        assembly.part(second).begin(versions[second])
    assert f"sender '{first}'" in str(info.value)
    with pytest.raises(SyncAbortedError, match="cannot be assembled"):
        _feed(assembly.part(first), w.make_state(versions[first]), shares[first])
    with pytest.raises((SyncAbortedError, VersionError)):
        assembly.part(first).prepare_commit(versions[first], 1.0)
    assembly.part(first).abort(SyncAbortedError("the transport aborts the part"))
    assert inner.version == -1
    assert inner.pending_version is None
    assert checksum(inner.live) == checksum(w.zeros_like_layout(layout))
    for name in shares:  # the next version, from both, goes through
        part = assembly.part(name)
        part.begin(7)
        _feed(part, w.make_state(7), shares[name])
    assembly.prepare_commit(7, 5.0)
    assembly.commit(7)
    assert checksum(inner.live) == checksum(w.make_state(7))


def test_a_part_does_not_take_another_parts_version_when_it_never_began() -> None:
    layout = _layout()
    shares = _halves(layout)
    assembly = Assembly(RecordingConsumer(layout), shares)
    assembly.part("a").begin(1)
    with pytest.raises((SyncAbortedError, VersionError), match="sender 'b'"):
        _feed(assembly.part("b"), w.make_state(1), shares["b"][:1])  # b never began version 1


def test_a_single_version_assembly_fails_fast_once_a_part_could_not_begin() -> None:
    """`once=True` (what SharesReceiver makes per receive): every part must announce the first
    part's version, and once the inner consumer refused that version the other parts fail at
    once instead of trying (and waiting) again."""
    layout = _layout()
    shares = _halves(layout)
    inner = RecordingConsumer(layout)
    inner.begin(0)
    _feed(inner, w.make_state(0), [b.index for b in layout.buckets])
    inner.commit(0)
    assembly = Assembly(inner, shares, once=True)
    with pytest.raises(VersionError, match="not newer"):
        assembly.part("a").begin(0)  # the inner consumer refuses a stale version
    with pytest.raises(SyncAbortedError, match="already failed"):
        assembly.part("b").begin(0)
    fresh = Assembly(RecordingConsumer(layout), shares, once=True)
    fresh.part("a").begin(3)
    fresh.part("a").abort(SyncAbortedError("its sender died"))
    with pytest.raises(VersionError, match="sender 'b' announces version 4"):
        fresh.part("b").begin(4)  # still the same receive: version 3 or nothing


def test_adapters_pass_a_delta_base_through_only_when_what_they_wrap_has_one() -> None:
    """Issue 27: a receive through policygroup's adapters (`ExpectedVersion`, `DeferredCommit`,
    `TimedConsumer`, an `AssemblyPart`) holds the base of a delta exactly when the buffer it wraps does, and
    rebuilds on that buffer's applied version; a part never lends a bucket outside its share."""
    layout = _layout()
    state = w.make_state(3)
    inner = DoubleBuffer(w.zeros_like_layout(layout), layout)
    inner.begin(3)
    _feed(inner, state, list(range(len(layout.buckets))))
    inner.commit(3)
    assembly = Assembly(TimedConsumer(ExpectedVersion(inner, 4)), _halves(layout))
    part = assembly.part("b")
    deferred = TimedConsumer(ExpectedVersion(DeferredCommit(inner), 4))  # a Double endpoint's receive
    wrapped = [ExpectedVersion(inner, 4), TimedConsumer(inner), deferred, part]
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    last = len(layout.buckets) - 1
    want = torch.empty(layout.buckets[last].nbytes, dtype=torch.uint8)
    assert pack_base(layout, last, inner.live, want)
    for consumer in wrapped:
        assert holds_base(consumer, 3), consumer
        assert not holds_base(consumer, 2), consumer
        out = scratch[: layout.buckets[last].nbytes]
        out.fill_(0xFF)
        assert consumer.copy_base(last, out)  # type: ignore[attr-defined]
        assert torch.equal(out, want)
    assert not part.copy_base(0, scratch[: layout.buckets[0].nbytes])  # bucket 0 is in share "a"
    discarding = DiscardingConsumer(layout, 4)  # holds nothing to rebuild on
    for consumer in (ExpectedVersion(discarding, 4), TimedConsumer(discarding)):
        assert not holds_base(consumer, 3)
        assert not consumer.copy_base(0, scratch[: layout.buckets[0].nbytes])
