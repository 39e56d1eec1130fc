"""LoadWeightsConsumer: an engine fed through ``load_weights`` under the two-phase commit."""

from __future__ import annotations

from typing import Any

import load_weights_workers as lw
import pytest
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    BucketConsumer,
    Cast,
    Layout,
    LayoutMismatchError,
    LoadWeightsConsumer,
    PartialLoadError,
    SharedBuffer,
    SharedBufferReader,
    TransformChain,
    VersionError,
    WeightSyncError,
    checksum,
    feed,
    pack_bucket,
)


def consumer_for(model: lw.ServingModel, mode: str = "staged", **kwargs: Any) -> LoadWeightsConsumer:
    told: list[PartialLoadError] = []
    consumer = LoadWeightsConsumer(
        lw.trainer_layout(),
        model.load_weights,
        finalize=model.process_weights_after_loading,
        transforms=lw.engine_transforms(),
        mode=mode,  # type: ignore[arg-type]
        expected=model.named(),
        on_partial=told.append,
        **kwargs,
    )
    consumer.told = told  # type: ignore[attr-defined]
    return consumer


def bucket(layout: Layout, version: int, index: int) -> torch.Tensor:
    buffer = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    return pack_bucket(layout, index, lw.trainer_state(version), buffer)


def _buckets_with_output(layout: Layout) -> int:
    chain = TransformChain(lw.engine_transforms())
    chain.start()
    count = 0
    for b in layout.buckets:
        metas = [(s.name, torch.empty(s.shape, dtype=s.torch_dtype, device="meta")) for s in b.tensors]
        count += any(True for n, t in metas for _ in chain.feed(n, t))
    return count


def test_is_a_bucket_consumer() -> None:
    assert isinstance(consumer_for(lw.ServingModel()), BucketConsumer)


@pytest.mark.parametrize("mode", ["staged", "stream"])
def test_versions_reach_the_engine_bit_exact_with_one_finalize_each(mode: str) -> None:
    model = lw.ServingModel()
    consumer = consumer_for(model, mode)
    layout = consumer.layout
    assert len(layout.buckets) > 4  # several buckets: fusion spans them
    for version in (1, 2):
        feed(consumer, lw.trainer_state(version).items(), version, 30.0)
        assert consumer.version == version
        assert lw.engine_checksum(model) == checksum(lw.engine_view(version))
        assert model.finalized == version  # once per version, after load_weights
        assert torch.equal(model.derived, model.named()["model.layers.0.mlp.gate_up_proj.weight"].t())
        assert consumer.torn is False
        assert consumer.extra_bytes == 0  # staging freed at commit
    # staged: one load_weights call per version; stream: one per bucket that yields weights (a
    # bucket holding only q and k of a layer yields nothing until v arrives)
    assert model.calls == 2 * (1 if mode == "staged" else _buckets_with_output(layout))
    if mode == "staged":  # what the engine's load_weights returned (its loaded names)
        assert consumer.last_result == set(lw.engine_view(0))


def test_staged_engine_untouched_by_an_aborted_version() -> None:
    model = lw.ServingModel()
    consumer = consumer_for(model)
    feed(consumer, lw.trainer_state(1).items(), 1)
    before = lw.engine_checksum(model)
    consumer.begin(2)
    for index in range(len(consumer.layout.buckets) - 1):
        consumer.consume(index, bucket(consumer.layout, 2, index))
    with pytest.raises(WeightSyncError, match=r"1 bucket\(s\) missing"):
        consumer.prepare_commit(2, 10.0)
    consumer.abort(RuntimeError("peer lost"))
    assert model.calls == 1
    assert model.finalized == 1  # only version 1 ever reached the engine
    assert lw.engine_checksum(model) == before
    assert consumer.version == 1
    assert consumer.torn is False
    assert consumer.told == []  # type: ignore[attr-defined]


def test_staged_load_weights_failure_is_reported_as_partial_staged() -> None:
    model = lw.ServingModel()
    consumer = consumer_for(model)
    feed(consumer, lw.trainer_state(1).items(), 1)
    model.fail_after = model.pairs + 3  # the engine breaks after three pairs of version 2
    with pytest.raises(PartialLoadError, match=r"mode 'staged'.*must be reloaded") as info:
        feed(consumer, lw.trainer_state(2).items(), 2)
    assert info.value.version == 2
    assert info.value.mode == "staged"
    assert consumer.version == 1  # never reported as holding version 2
    assert consumer.torn is True
    assert consumer.told == [consumer.last_error]  # type: ignore[attr-defined]
    assert model.finalized == 1  # no post-processing of a half-loaded version
    model.fail_after = None
    feed(consumer, lw.trainer_state(3).items(), 3)  # a complete version repairs the engine
    assert consumer.torn is False
    assert consumer.version == 3
    assert lw.engine_checksum(model) == checksum(lw.engine_view(3))


def test_finalize_failure_is_a_partial_load() -> None:
    model = lw.ServingModel()

    def broken() -> None:
        raise RuntimeError("repacking failed")

    consumer = LoadWeightsConsumer(
        lw.trainer_layout(), model.load_weights, finalize=broken, transforms=lw.engine_transforms()
    )
    with pytest.raises(PartialLoadError, match=r"finalize raised.*repacking failed"):
        feed(consumer, lw.trainer_state(1).items(), 1)
    assert consumer.version == -1
    assert consumer.torn is True


def test_stream_abort_after_a_fed_bucket_tells_the_engine() -> None:
    model = lw.ServingModel()
    consumer = consumer_for(model, "stream")
    feed(consumer, lw.trainer_state(1).items(), 1)
    consumer.begin(2)
    consumer.consume(0, bucket(consumer.layout, 2, 0))
    assert consumer.torn is True  # bucket 0 already went into the engine
    consumer.abort(ConnectionError("sender died"))
    error = consumer.last_error
    assert isinstance(error, PartialLoadError)
    assert error.mode == "stream"
    assert error.version == 2
    assert "holds a mix of version 1 and version 2 and must be reloaded" in str(error)
    assert "sender died" in str(error)
    assert consumer.told == [error]  # type: ignore[attr-defined]
    assert consumer.version == 1
    # an abort before anything was fed leaves the engine as it was: nothing to report
    fresh = consumer_for(lw.ServingModel(), "stream")
    fresh.begin(1)
    fresh.abort(ConnectionError("sender died"))
    assert fresh.torn is False
    assert fresh.told == []  # type: ignore[attr-defined]
    assert not isinstance(fresh.last_error, PartialLoadError)


def test_stream_engine_failure_in_a_bucket_names_the_mode() -> None:
    model = lw.ServingModel(fail_after=2)
    consumer = consumer_for(model, "stream")
    with pytest.raises(PartialLoadError, match=r"raised while loading version 1 \(mode 'stream'\)"):
        feed(consumer, lw.trainer_state(1).items(), 1)
    assert consumer.torn is True
    assert consumer.version == -1


def test_expected_engine_weights_are_checked_before_any_sync() -> None:
    model = lw.ServingModel()
    layout = lw.trainer_layout()
    wrong = dict(model.named())
    wrong["model.layers.0.self_attn.qkv_proj.weight"] = torch.zeros(3, 3, dtype=torch.bfloat16)
    with pytest.raises(LayoutMismatchError, match=r"qkv_proj.weight' as bfloat16 \(96, 64\)"):
        LoadWeightsConsumer(layout, model.load_weights, transforms=lw.engine_transforms(), expected=wrong)
    extra = {**model.named(), "model.extra": torch.zeros(1)}
    with pytest.raises(LayoutMismatchError, match=r"engine expects 'model.extra'"):
        LoadWeightsConsumer(layout, model.load_weights, transforms=lw.engine_transforms(), expected=extra)
    with pytest.raises(LayoutMismatchError, match=r"as float32 \(50, 64\), the engine expects bfloat16"):
        LoadWeightsConsumer(layout, model.load_weights, expected=model.named())  # no cast
    with pytest.raises(LayoutMismatchError, match=r"q_proj.weight', which the engine does not expect"):
        LoadWeightsConsumer(layout, model.load_weights, transforms=[Cast("bfloat16")], expected=model.named())
    no_v = Layout([(s.name, s.shape, s.dtype) for s in layout.tensors if "v_proj" not in s.name], lw.BUCKET)
    with pytest.raises(LayoutMismatchError, match=r"missing shard"):
        LoadWeightsConsumer(no_v, model.load_weights, transforms=lw.engine_transforms())
    with pytest.raises(ValueError, match=r"'staged' or 'stream'"):
        LoadWeightsConsumer(layout, model.load_weights, mode="lazy")  # type: ignore[arg-type]


def test_versions_must_increase_and_feed_names_bad_streams() -> None:
    model = lw.ServingModel()
    consumer = consumer_for(model)
    feed(consumer, lw.trainer_state(1).items(), 1)
    with pytest.raises(VersionError):
        feed(consumer, lw.trainer_state(1).items(), 1)
    state = lw.trainer_state(2)
    name = "model.layers.1.mlp.up_proj.weight"
    short = {k: v for k, v in state.items() if k != name}
    with pytest.raises(WeightSyncError, match=f"ended without '{name}'"):
        feed(consumer, short.items(), 2)
    bad = dict(state)
    bad[name] = bad[name].double()
    with pytest.raises(LayoutMismatchError, match=f"'{name}' is float64"):
        feed(consumer, bad.items(), 2)
    with pytest.raises(LayoutMismatchError, match=r"'nope' is not in the layout"):
        feed(consumer, [*state.items(), ("nope", torch.ones(1))], 2)
    assert consumer.version == 1
    assert model.calls == 1  # none of it reached the engine
    assert lw.engine_checksum(model) == checksum(lw.engine_view(1))


def test_staged_receiver_reads_a_shared_buffer_checked_bucket_by_bucket() -> None:
    """A node's SharedBuffer copied out into an engine (`copy_version`): same bytes, same result."""
    layout = lw.trainer_layout()
    with SharedBuffer(layout, 1, checksums=True) as shared:
        shared.publish(lw.trainer_state(5), 5)
        with SharedBufferReader.attach(shared.name) as reader:
            model = lw.ServingModel()
            reader.copy_version(5, consumer_for(model))
    assert lw.engine_checksum(model) == checksum(lw.engine_view(5))


# -- real processes ------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_broadcast_into_engines_in_other_processes_staged_and_stream() -> None:
    """gloo broadcast over a MemberGroup from process 0 to a staged and a streaming engine; version
    3 fails on the sender after two buckets went out: the staged engine keeps version 2 untouched,
    the streaming one is told it is partly loaded; version 4 repairs it."""
    results = w.run_ranks(lw.scenario_load_weights_broadcast, 3, timeout=200.0)
    assert "SyncAbortedError" in results[0]["v3"]
    want = {v: checksum(lw.engine_view(v)) for v in (1, 2, 4)}
    for rank, mode in ((1, "staged"), (2, "stream")):
        got = results[rank]
        for v in (1, 2, 4):
            assert got[f"v{v}"]["version"] == v, (mode, got[f"v{v}"])
            assert got[f"v{v}"]["checksum"] == want[v], mode
            assert got[f"v{v}"]["torn"] is False
            assert got[f"v{v}"]["derived_ok"]
        failed = got["v3"]
        assert "SyncAbortedError" in failed["error"]
        assert failed["version"] == 2
        assert failed["finalized"] == 2
        if mode == "staged":
            assert failed["checksum"] == want[2]  # untouched
            assert failed["torn"] is False
            assert failed["partial"] is None
            assert failed["told"] == []
        else:
            assert failed["checksum"] not in (want[2], checksum(lw.engine_view(3)))  # a mix
            assert failed["torn"] is True
            assert failed["told"] == ["stream:3"]
            assert failed["partial"][:2] == ("stream", 3)
            assert "must be reloaded" in failed["partial"][2]
        assert got["v4"]["told"] == failed["told"]  # told once, not again by the repair
