"""`LoadWeightsConsumer(mode="stream")` hands `load_weights` memory it may write: an engine loader
that writes into the tensors it is given, in a reader process fed by ShmRing, CUDA IPC (host
slots) or the node buffer's `copy_version`, all of which land buckets in memory the reader
must not write, sees each version bit-exact and leaves the source intact; the process lives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import weightsync_dist_workers as w
import writing_loader_workers as wl

from rlfleet.weightsync import LoadWeightsConsumer, SharedBuffer, SharedBufferReader, checksum, feed


@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", wl.TRANSPORTS)
def test_a_loader_that_writes_in_place_gets_memory_it_may_write(tmp_path: Path, transport: str) -> None:
    results: dict[int, Any] = w.run_ranks(
        wl.scenario_writing_loader, 2, str(tmp_path / "name"), transport, timeout=180.0
    )  # a SIGSEGV in the reader is a rank that died: run_ranks fails naming it
    sender, reader = results[0], results[1]
    for version in wl.VERSIONS:
        got = reader[f"v{version}"]
        assert got["ok"], got
        assert got["applied"] == version
        assert got["seen"] == checksum(w.make_state(version)), "the engine saw other bytes"
        assert got["copied"] == w.layout_of(w.make_state(0)).padded_bytes  # every bucket, once
        if transport != "copy_version":
            assert sender[f"v{version}"]["ok"], sender[f"v{version}"]
    if transport == "copy_version":
        assert sender["node"] == checksum(w.make_state(2))  # the node buffer holds what was published


def test_memory_of_its_own_is_handed_over_as_it_is() -> None:
    """Buckets landed in memory the receiver owns (`feed`'s buffers, a broadcast's) are not copied;
    ``writes_inputs=False`` hands even lent memory over as it lies."""
    engine = wl.WritingEngine()
    consumer = LoadWeightsConsumer(w.layout_of(w.make_state(0)), engine.load_weights, mode="stream")
    feed(consumer, w.make_state(1).items(), 1, 30.0)
    assert consumer.copied_bytes == 0
    assert checksum(engine.seen) == checksum(w.make_state(1))
    trusting = LoadWeightsConsumer(consumer.layout, engine.load_weights, mode="stream", writes_inputs=False)
    assert trusting.writes_inputs is False


def test_a_loader_that_keeps_what_it_was_handed_until_later_sees_each_bucket_intact() -> None:
    """vLLM's layerwise reload holds a layer's tensors until the layer is complete: the private
    copies of lent buckets must not be reused for the next bucket."""
    state = w.make_state(3)
    layout = w.layout_of(state, 4096)  # several buckets
    assert len(layout.buckets) > 2
    kept: dict[str, torch.Tensor] = {}

    def keep(weights: Any) -> None:
        for name, tensor in weights:
            kept[name] = tensor  # a reference, read only at the end

    with SharedBuffer(layout, 1) as node:
        node.publish(state, 3, 30.0)
        reader = SharedBufferReader.attach(node.name)
        try:
            consumer = LoadWeightsConsumer(layout, keep, mode="stream")
            reader.copy_version(3, consumer, 30.0)
        finally:
            reader.close()
    assert consumer.copied_bytes == layout.padded_bytes  # lent memory: copied first
    assert checksum(kept) == checksum(state)
