"""NCCL through CuPy: what runs without a GPU (ids, errors), and the real thing on one."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import MetadataError, NcclSender, NcclWire, checksum
from rlfleet.weightsync._nccl import decode_unique_id, encode_unique_id, nccl_ranks

HAS_CUPY = importlib.util.find_spec("cupy") is not None


def test_unique_id_round_trips_as_json() -> None:
    raw = os.urandom(128)
    assert decode_unique_id(encode_unique_id(raw)) == raw
    ints = tuple((i * 7) % 256 - 128 for i in range(128))
    assert decode_unique_id(encode_unique_id(ints)) == ints


@pytest.mark.parametrize(
    "text",
    ["", "[]", '{"b64": "AAAA"}', '{"ints": [1, 2]}', '{"ints": ["x"]}', '{"b64": "!!"}', "\xff"],
)
def test_malformed_unique_id_is_rejected(text: str) -> None:
    with pytest.raises((MetadataError, ValueError)):
        decode_unique_id(text)


def test_nccl_rank_of_a_member() -> None:
    assert nccl_ranks([4, 2, 9], 9) == 2
    with pytest.raises(ValueError, match="not among"):
        nccl_ranks([4, 2], 3)


@pytest.mark.skipif(HAS_CUPY, reason="cupy is installed here")
def test_without_cupy_the_error_names_the_extras() -> None:
    store = torch.distributed.HashStore()
    with pytest.raises(ImportError, match=r"\[cuda12\].*\[cuda13\]"):
        NcclWire.create(store, 0, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_CUPY, reason="needs CUDA and cupy")
def test_one_rank_communicator_runs_the_bucket_loop() -> None:
    store = torch.distributed.HashStore()
    wire = NcclWire.create(store, 0, 1, deadline=60.0)
    sd = {k: v.cuda() for k, v in w.make_state(1).items()}
    layout = w.layout_of(sd)
    sender = NcclSender(layout, wire, checksums=True, direct_min=w.DIRECT_MIN)
    stats = sender.send(sd, 1, 60.0)
    assert stats.wire_bytes == sum(t.nbytes for t in sd.values())
    assert checksum(sd) == checksum(w.make_state(1))
    wire.close()
