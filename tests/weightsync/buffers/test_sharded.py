"""Strategy "Sharded": 1/N per receiver, all-gathered bit-exact over real gloo."""

from __future__ import annotations

import pytest
import torch
import weightsync_dist_workers as w
from hypothesis import given
from hypothesis import strategies as st

from rlfleet.weightsync import (
    BucketConsumer,
    IncompleteSyncError,
    ShardedBuffer,
    VersionError,
    WeightSyncError,
    balanced_ranges,
    checksum,
    pack_bucket,
)


@given(st.lists(st.integers(0, 10_000), max_size=60), st.integers(1, 9))
def test_balanced_ranges_partition_in_order(sizes: list[int], parts: int) -> None:
    runs = balanced_ranges(sizes, parts)
    assert len(runs) == parts
    assert [i for run in runs for i in run] == list(range(len(sizes)))
    if sizes and parts > 1:
        biggest = max(sum(sizes[i] for i in run) for run in runs)
        assert biggest <= sum(sizes) / parts + max(sizes)


def test_sharded_keeps_only_its_buckets_and_stays_intact_on_abort() -> None:
    sd = w.make_state(1)
    layout = w.layout_of(sd, bucket=8 * 1024)
    buffers = [ShardedBuffer(layout, r, 3) for r in range(3)]
    assert isinstance(buffers[0], BucketConsumer)
    assert sorted(i for b in buffers for i in b.owned) == [b.index for b in layout.buckets]
    assert all(b.shard_bytes < layout.padded_bytes * 0.6 for b in buffers)
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    for buf in buffers:
        buf.begin(1)
        for bucket in layout.buckets:
            buf.consume(bucket.index, pack_bucket(layout, bucket.index, sd, scratch))
        buf.commit(1)
    before = [b.shard.clone() for b in buffers]
    buffers[0].begin(2)
    buffers[0].consume(0, pack_bucket(layout, 0, w.make_state(2), scratch))
    buffers[0].abort(RuntimeError("transport failed"))
    assert buffers[0].version == 1
    assert torch.equal(buffers[0].shard, before[0])
    with pytest.raises(VersionError):
        buffers[1].begin(1)
    buffers[1].begin(2)
    with pytest.raises(IncompleteSyncError):
        buffers[1].commit(2)
    assert torch.equal(buffers[1].shard, before[1])
    with pytest.raises(WeightSyncError):
        buffers[2].consume(0, scratch[: layout.buckets[0].nbytes])  # outside a sync


@pytest.mark.timeout(150)
def test_sharded_gather_is_bit_exact_over_gloo() -> None:
    results = w.run_ranks(w.scenario_sharded, 4, timeout=120.0)
    members = [results[r] for r in (1, 2, 3)]
    owned = sorted(i for m in members for i in m["owned"])
    assert owned == list(range(len(owned)))
    for version in (1, 2):
        expected = checksum(w.make_state(version))
        for m in members:
            assert m[f"v{version}"] == expected
            assert m[f"v{version}_names"]
    for m in members:
        assert m["mixed"]["type"] == "VersionError"
        assert "9" in m["mixed"]["message"]
