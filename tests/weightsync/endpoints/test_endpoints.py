"""Receive strategies (endpoints) and their consumers, without Ray: real SharedBuffer segments in
this process, and a real gloo wire between spawned processes."""

from __future__ import annotations

import threading
from typing import Any

import endpoint_workers as ew
import pytest
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    WEIGHT_BUFFER_STRATEGIES,
    ChecksumMismatchError,
    DeferredCommit,
    DirectBuffer,
    DiscardingConsumer,
    DoubleBuffer,
    IncompleteSyncError,
    Layout,
    LayoutMismatchError,
    ServingLock,
    SharedBuffer,
    SyncTimeoutError,
    VersionError,
    WeightSyncError,
    bucket_starts,
    check_strategy,
    checksum,
    commit_consumer,
    create_endpoint,
    live_tensors,
    module_part_buffer,
    pack_all,
)
from rlfleet.weightsync.shm._shared_format import SlotTable
from rlfleet.weightsync.shm._shm import SharedSegment

LAYOUT = ew.layout()


def equal_to(module: torch.nn.Module, version: int) -> bool:
    return checksum(module.state_dict()) == checksum(ew.state(version))


@pytest.fixture
def node_buffer() -> Any:
    """A node's shared buffer holding versions 1 and 2, written by this process (as a trainer)."""
    writer = SharedBuffer(LAYOUT, 3, timeout_s=10.0, checksums=True)
    writer.publish(ew.state(1), 1)
    yield writer
    writer.close()


def test_strategy_names_are_the_seeds_and_checked() -> None:
    assert WEIGHT_BUFFER_STRATEGIES == ("None", "Double", "Shared", "Sharded")
    assert check_strategy("Double") == "Double"
    with pytest.raises(ValueError, match="'Triple' is unknown; valid: None, Double, Shared, Sharded"):
        check_strategy("Triple")
    with pytest.raises(ValueError, match="'Triple' is unknown"):
        create_endpoint("Triple", ew.make_module(), LAYOUT)
    with pytest.raises(ValueError, match="needs the name of its node's buffer"):
        create_endpoint("Shared", ew.make_module(), LAYOUT)
    with pytest.raises(ValueError, match=r"needs its share \(shard="):
        create_endpoint("Sharded", ew.make_module(), LAYOUT)


@pytest.mark.parametrize("strategy", ["None", "Double"])
def test_private_copy_from_the_node_buffer(node_buffer: SharedBuffer, strategy: str) -> None:
    module = ew.make_module()
    endpoint = create_endpoint(strategy, module, LAYOUT, node_buffer=node_buffer.name)
    try:
        assert endpoint.stage_from_node(node_buffer.name, 1, 10.0) == 1
        if strategy == "Double":  # staged: the module serves version 0 until the swap
            assert (endpoint.version, endpoint.staged_version) == (0, 1)
            assert equal_to(module, 0)
            assert not endpoint.wait_applied(0.01)
            with pytest.raises(VersionError, match="asked to apply v2, staged is v1"):
                endpoint.apply(2)
            assert endpoint.apply(1) == 1
        assert (endpoint.version, endpoint.staged_version) == (1, None)
        assert equal_to(module, 1)
        assert endpoint.wait_applied(0.01)
        assert endpoint.stage_from_node(node_buffer.name, 1, 10.0) == 1  # a retry: nothing to do
        with pytest.raises(WeightSyncError, match="not a reader of node buffer 'elsewhere'"):
            endpoint.stage_from_node("elsewhere", 2)
    finally:
        endpoint.release()
    assert equal_to(module, 1)


def test_shared_binds_zero_copy_and_release_gives_private_storage(node_buffer: SharedBuffer) -> None:
    modules = [ew.make_module(), ew.make_module()]
    endpoints = [create_endpoint("Shared", m, LAYOUT, node_buffer=node_buffer.name) for m in modules]
    try:
        for endpoint in endpoints:
            endpoint.stage_from_node(node_buffer.name, 1, 10.0)
            assert equal_to(modules[0], 0)  # not bound before the swap
        for endpoint in endpoints:
            endpoint.apply(1)
        for module, endpoint in zip(modules, endpoints, strict=True):  # the one copy serves both
            start, end = endpoint.data_range()  # type: ignore[attr-defined]
            assert all(start <= t.data_ptr() < end for t in live_tensors(module).values())
        assert all(equal_to(m, 1) for m in modules)
        node_buffer.publish(ew.state(2), 2)
        endpoints[0].stage_from_node(node_buffer.name, 2, 10.0)
        endpoints[0].apply(2)
        assert equal_to(modules[0], 2)
        assert equal_to(modules[1], 1)  # still bound to the slot of version 1
    finally:
        for endpoint in endpoints:
            endpoint.release()
    assert equal_to(modules[0], 2)
    assert all(t.untyped_storage().resizable() for t in live_tensors(modules[0]).values())
    with torch.no_grad():  # writable again: no longer the read-only mapping
        next(modules[0].parameters()).add_(1.0)


def test_a_shared_swap_takes_the_newest_committed_version_and_says_so(node_buffer: SharedBuffer) -> None:
    """Async RL: v2 committed while the worker still had v1 staged: its swap binds v2 at once (it
    skips ahead, no queue of stale versions) and its version says v2, what it really serves."""
    module = ew.make_module()
    endpoint = create_endpoint("Shared", module, LAYOUT, node_buffer=node_buffer.name)
    try:
        endpoint.stage_from_node(node_buffer.name, 1, 10.0)
        node_buffer.publish(ew.state(2), 2)  # the trainer moved on before this worker's swap
        assert endpoint.apply(1) == 2
        assert (endpoint.version, endpoint.staged_version) == (2, None)
        assert equal_to(module, 2)
    finally:
        endpoint.release()


@pytest.mark.parametrize("strategy", ["None", "Double", "Shared"])
def test_a_worker_asked_for_a_version_the_writer_replaced_takes_the_newest(strategy: str) -> None:
    """v1 was overwritten (v2 and v3 committed) before this worker took it: it stages v3 (skips
    ahead, never a queue of stale versions), and an apply of v1 makes v3 live; a version not
    committed yet is waited for, within the deadline."""
    writer = SharedBuffer(LAYOUT, 1, timeout_s=10.0)
    module = ew.make_module()
    endpoint = create_endpoint(strategy, module, LAYOUT, node_buffer=writer.name)
    try:
        for version in (1, 2, 3):
            writer.publish(ew.state(version), version)
        assert endpoint.stage_from_node(writer.name, 1, 10.0) == 3
        assert endpoint.apply(1) == 3
        assert endpoint.version == 3
        assert equal_to(module, 3)
        with pytest.raises(SyncTimeoutError):  # nothing newer than v3 to take: v4 is waited for
            endpoint.stage_from_node(writer.name, 4, 0.05)
    finally:
        endpoint.release()
        writer.close()


def test_a_corrupted_node_buffer_is_refused_and_nothing_is_applied(node_buffer: SharedBuffer) -> None:
    module = ew.make_module()
    endpoint = create_endpoint("Shared", module, LAYOUT, node_buffer=node_buffer.name)
    try:
        endpoint.stage_from_node(node_buffer.name, 1, 10.0)
        endpoint.apply(1)
        node_buffer.publish(ew.state(2), 2)
        segment = SharedSegment.attach(node_buffer.name)
        try:  # flip one byte of version 2's slot, as a faulty writer or a stray write would
            table, plan, _ = SlotTable.of(segment)
            slot = table.slot_holding(2)
            assert slot is not None
            segment.buffer[plan.data_offset + slot * plan.slot_bytes] ^= 0x40
            table.detach()
        finally:
            segment.close()
        with pytest.raises(ChecksumMismatchError):
            endpoint.stage_from_node(node_buffer.name, 2, 10.0)
        assert (endpoint.version, endpoint.staged_version) == (1, None)
        assert equal_to(module, 1)
    finally:
        endpoint.release()


def test_an_apply_that_cannot_drain_keeps_serving_the_previous_version(node_buffer: SharedBuffer) -> None:
    module = ew.make_module()
    endpoint = create_endpoint("Double", module, LAYOUT, node_buffer=node_buffer.name)
    try:
        endpoint.stage_from_node(node_buffer.name, 1, 10.0)
        serving, release = threading.Event(), threading.Event()

        def serve() -> None:
            with endpoint.serving_lock.shared(10.0):
                serving.set()
                release.wait(10.0)

        thread = threading.Thread(target=serve)
        thread.start()
        assert serving.wait(10.0)
        with pytest.raises(SyncTimeoutError, match="in-flight requests"):
            endpoint.apply(1, 0.2)
        assert (endpoint.version, endpoint.staged_version) == (0, 1)
        assert equal_to(module, 0)
        release.set()
        thread.join(10.0)
        assert endpoint.apply(1, 10.0) == 1
        assert equal_to(module, 1)
    finally:
        endpoint.release()


class _RefusingBuffer(DoubleBuffer):
    """A DoubleBuffer whose `prepare_commit` refuses (the contract's optional method)."""

    def prepare_commit(self, version: int, deadline: Any = None) -> None:
        raise WeightSyncError(f"cannot take version {version} now")


def test_commit_consumer_prepares_when_it_can() -> None:
    module = ew.make_module()
    plain = DirectBuffer(live_tensors(module), LAYOUT)
    plain.begin(1)
    for bucket in LAYOUT.buckets:
        plain.consume(bucket.index, torch.zeros(bucket.nbytes, dtype=torch.uint8))
    commit_consumer(plain, 1, None)  # type: ignore[arg-type]
    assert plain.version == 1
    refusing = _RefusingBuffer(live_tensors(ew.make_module()), LAYOUT)
    refusing.begin(1)
    with pytest.raises(WeightSyncError, match="cannot take version 1"):
        commit_consumer(refusing, 1, None)  # type: ignore[arg-type]
    assert (refusing.version, refusing.pending_version) == (-1, None)  # aborted, nothing applied


def test_deferred_commit_checks_completeness_and_leaves_the_inner_commit() -> None:
    module = ew.make_module()
    inner = DoubleBuffer(live_tensors(module), LAYOUT)
    deferred = DeferredCommit(inner)
    assert deferred.layout is LAYOUT
    deferred.begin(1)
    flat = pack_all(LAYOUT, ew.state(1))
    starts = bucket_starts(LAYOUT)
    for bucket, start in zip(LAYOUT.buckets[:-1], starts, strict=False):
        deferred.consume(bucket.index, flat[start : start + bucket.nbytes])
    with pytest.raises(IncompleteSyncError, match="missing 1 of"):
        deferred.prepare_commit(1)
    last = LAYOUT.buckets[-1]
    deferred.consume(last.index, flat[starts[-1] : starts[-1] + last.nbytes])
    deferred.commit(1)
    assert (deferred.staged, inner.version, inner.pending_version) == (1, -1, 1)
    assert equal_to(module, 0)
    inner.commit(1)
    assert equal_to(module, 1)
    deferred.begin(2)
    deferred.abort(RuntimeError("peer lost"))
    assert (deferred.staged, inner.pending_version, inner.version) == (None, None, 1)


def test_discarding_consumer_accepts_a_held_version_and_changes_nothing() -> None:
    sink = DiscardingConsumer(LAYOUT, 4)
    assert (sink.layout, sink.version) == (LAYOUT, 3)
    sink.begin(4)
    sink.consume(0, torch.zeros(LAYOUT.buckets[0].nbytes, dtype=torch.uint8))
    sink.commit(4)
    assert sink.version == 3


@pytest.fixture(scope="module")
def wire_run() -> dict[int, Any]:
    return w.run_ranks(ew.scenario_endpoints, 6, timeout=240.0)


@pytest.mark.timeout(300)
def test_every_strategy_over_a_gloo_wire(wire_run: dict[int, Any]) -> None:
    want = [checksum(ew.state(v)) for v in (1, 2, 2)]
    before = checksum(ew.state(0))
    for rank in range(1, 6):
        rounds = wire_run[rank]["rounds"]
        for version, (round_, expected) in enumerate(zip(rounds, want, strict=True), start=1):
            version = min(version, 2)
            assert round_["applied"] == {"version": version, "staged": None, "checksum": expected}, rank
        first = rounds[0]["received"]
        if ew.STRATEGY[rank] == "None":  # applied as it arrived
            assert first == {"version": 1, "staged": None, "checksum": want[0]}
        else:  # staged: the module served version 0 until its apply
            assert first == {"version": 0, "staged": 1, "checksum": before}, rank
        assert rounds[2]["received"]["staged"] is None  # a retry of a held version stages nothing
        assert wire_run[rank]["after_release"] == want[-1]
    reader_rounds = wire_run[1]["rounds"]
    assert [r["reader"]["checksum"] for r in reader_rounds] == want
    assert all(r["zero_copy"] for r in reader_rounds)
    assert wire_run[3]["private"]


def test_module_part_buffer_resumes_the_version_and_names_a_mismatch() -> None:
    module = ew.make_module()
    part = Layout.from_state_dict({"0.weight": module.state_dict()["0.weight"]}, 1024)
    lock = ServingLock()
    buffer = module_part_buffer(module, part, version=3, serving_lock=lock, who="generation worker 1")
    assert (buffer.version, buffer.serving_lock) == (3, lock)
    with pytest.raises(VersionError, match="not newer than the applied version 3"):
        buffer.begin(3)
    buffer.begin(4)
    source = torch.full_like(module.state_dict()["0.weight"], 0.5)
    buffer.consume(0, pack_all(part, {"0.weight": source})[: part.buckets[0].nbytes])
    buffer.commit(4)
    assert torch.equal(module.state_dict()["0.weight"], source)
    other = Layout.from_state_dict({"0.weight": torch.zeros(3, 3)}, 1024)
    with pytest.raises(
        LayoutMismatchError, match=r"generation worker 1: parameter '0\.weight' has shape"
    ) as info:
        module_part_buffer(module, other, version=0, who="generation worker 1")
    assert info.value.parameter == "0.weight"


@pytest.mark.timeout(300)
def test_a_version_other_than_the_one_asked_for_lands_nowhere() -> None:
    """`receive(transport, 5)` from a sender announcing v9 refuses v9 before any byte lands, on
    every strategy: "None" keeps serving what it had (and the next honest version is applied),
    "Shared" never commits v9 to the node buffer, "Double"/"Sharded" stage nothing; the same when
    the endpoint already holds the asked version (the retry path that drops the bytes)."""
    results = w.run_ranks(ew.scenario_announced_version, 6, timeout=240.0)
    sent = results[0]["rounds"]
    for index, (announced, asked) in enumerate(ew.ANNOUNCED):
        if announced == asked:
            assert sent[index]["ok"], sent[index]
        else:
            assert sent[index]["type"] == "VersionError", sent[index]  # the sender is told
    for rank in range(1, 6):
        rounds = results[rank]["rounds"]
        held = 0
        for index, (announced, asked) in enumerate(ew.ANNOUNCED):
            got = rounds[index]
            if announced == asked:
                assert got["ok"], (rank, got)
                held = asked
            else:
                assert got["type"] == "VersionError", (rank, got)
                assert f"v{asked}" in got["message"] or f"version {asked}" in got["message"], got
                assert got["received"]["staged"] in (None, held), (rank, got)
                if "node_buffer" in got:
                    assert got["node_buffer"] == held, (rank, got)  # v9 never in the node buffer
            applied = got["applied"]
            assert applied["version"] == held, (rank, index, got)
            assert applied["checksum"] == checksum(ew.state(held)), (rank, index, got)
