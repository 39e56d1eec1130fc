"""SGLang's flattened-bucket format straight from rlfleet's buckets (no SGLang here).

`rebuild` restates what SGLang does with a payload (``FlattenedTensorBucket.reconstruct_tensors``
in ``python/sglang/srt/weight_sync/tensor_bucket.py``, read at sgl-project/sglang 07e9000:
``flattened_tensor[meta.start_idx : meta.end_idx].reshape(meta.shape)``, then ``.to(meta.dtype)``
only when the dtypes differ), and the payloads cross a real ``ForkingPickler`` (what SGLang's
``MultiprocessingSerializer`` uses) where a test says so.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import pytest
import torch

from rlfleet.weightsync import (
    Layout,
    MetadataError,
    PartialLoadError,
    SharedBuffer,
    SharedBufferReader,
    checksum,
    pack_bucket,
)
from rlfleet.weightsync.engines import FlattenedTensorMeta, SglangBucketConsumer, flattened_bucket


def state(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {
        "embed.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
        "layers.0.q.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(16, generator=g),  # float32 in the same bucket
        "layers.0.step": torch.tensor([version], dtype=torch.int64),
        "lm_head.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
    }


def rebuild(payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    flat = payload["flattened_tensor"]
    out = []
    for meta in payload["metadata"]:
        tensor = flat[meta.start_idx : meta.end_idx].reshape(meta.shape)
        if tensor.dtype != meta.dtype:
            tensor = tensor.to(meta.dtype)
        out.append((meta.name, tensor))
    return out


class StandInSglang:
    """What SGLang's engine does with one flattened-bucket call per tensor-parallel rank."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.calls = 0
        self.flushes = 0
        self.fail_on_call = fail_on_call
        self.pointers: list[int] = []

    def update(self, payload: dict[str, Any]) -> tuple[bool, str]:
        self.calls += 1
        if self.calls == self.fail_on_call:
            return False, "Failed to update weights: injected"
        self.pointers.append(payload["flattened_tensor"].data_ptr())
        for name, tensor in rebuild(payload):
            self.weights[name] = tensor.clone()
        return True, "Succeeded to update model weights."

    def flush(self) -> bool:
        self.flushes += 1
        return True


def test_payloads_are_typed_views_of_the_bucket_one_per_dtype() -> None:
    layout = Layout.from_state_dict(state(1), bucket_bytes=1 << 20)
    assert len(layout.buckets) == 1
    flat = torch.zeros(layout.buckets[0].nbytes, dtype=torch.uint8)
    pack_bucket(layout, 0, state(1), flat)
    payloads = flattened_bucket(layout, 0, flat)
    dtypes = sorted(str(p["flattened_tensor"].dtype) for p in payloads)
    assert dtypes == ["torch.bfloat16", "torch.float32", "torch.int64"]
    for payload in payloads:
        assert payload["flattened_tensor"].data_ptr() == flat.data_ptr()  # the bucket itself: no copy
    rebuilt = dict(pair for p in payloads for pair in rebuild(p))
    assert checksum(rebuilt) == checksum(state(1))
    for name, tensor in rebuilt.items():
        assert flat.data_ptr() <= tensor.data_ptr() < flat.data_ptr() + flat.numel(), name


def test_a_payload_crosses_the_forking_pickler_and_names_can_be_renamed() -> None:
    layout = Layout.from_state_dict(state(2), bucket_bytes=1 << 20)
    flat = torch.zeros(layout.buckets[0].nbytes, dtype=torch.uint8)
    pack_bucket(layout, 0, state(2), flat)
    payloads = flattened_bucket(layout, 0, flat, rename=lambda n: "model." + n)
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(payloads)
    again = pickle.loads(buffer.getvalue())
    rebuilt = dict(pair for p in again for pair in rebuild(p))
    assert checksum(rebuilt) == checksum({"model." + n: t for n, t in state(2).items()})
    assert all(isinstance(m, FlattenedTensorMeta) for p in again for m in p["metadata"])


@pytest.mark.parametrize("mode", ["staged", "stream"])
def test_the_consumer_refits_every_version_one_call_per_bucket_and_dtype(mode: str) -> None:
    layout = Layout.from_state_dict(state(0), bucket_bytes=2048)
    engine = StandInSglang()
    consumer = SglangBucketConsumer(layout, engine.update, flush=engine.flush, mode=mode)  # type: ignore[arg-type]
    calls = sum(len({s.dtype for s in b.tensors}) for b in layout.buckets)
    with SharedBuffer(layout, 1, checksums=True) as node, SharedBufferReader.attach(node.name) as reader:
        start, end = reader.data_range()
        for version in (1, 2, 3):
            node.publish(state(version), version)
            reader.copy_version(version, consumer, 30.0)
            assert checksum(engine.weights) == checksum(state(version))
            assert consumer.version == version
        in_shm = [start <= p < end for p in engine.pointers]
    assert engine.calls == 3 * calls
    assert engine.flushes == 3
    assert all(in_shm) if mode == "stream" else not any(in_shm)  # stream: straight from the node buffer


def test_an_engine_failure_is_a_partial_load_naming_the_bucket() -> None:
    layout = Layout.from_state_dict(state(0), bucket_bytes=2048)
    engine = StandInSglang(fail_on_call=2)
    consumer = SglangBucketConsumer(layout, engine.update, flush=engine.flush)
    with SharedBuffer(layout, 1) as node, SharedBufferReader.attach(node.name) as reader:
        node.publish(state(1), 1)
        with pytest.raises(PartialLoadError, match=r"bucket \d+ of version 1.*injected"):
            reader.copy_version(1, consumer, 30.0)
        assert consumer.version == -1
        assert consumer.torn
        node.publish(state(2), 2)
        reader.copy_version(2, consumer, 30.0)  # the next complete version repairs the engine
    assert checksum(engine.weights) == checksum(state(2))
    assert not consumer.torn


def test_bad_buckets_are_refused_by_name() -> None:
    layout = Layout.from_state_dict(state(0), bucket_bytes=2048)
    with pytest.raises(MetadataError, match="bucket 99"):
        flattened_bucket(layout, 99, torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(MetadataError, match="flat uint8"):
        flattened_bucket(layout, 0, torch.zeros(3))
    with pytest.raises(ValueError, match="mode"):
        SglangBucketConsumer(layout, lambda p: None, mode="later")  # type: ignore[arg-type]
