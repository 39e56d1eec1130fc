"""An FSDP2 trainer (``fully_shard`` on 2 gloo ranks, CPU) streaming to engines in other processes.

One parameter is gathered at a time (``DTensor.full_tensor()``) and fed, bucket by bucket, into
the node's SharedBuffer; a receiver on the node copies each version into an engine through
``load_weights``, and the trainer broadcasts it to a receiver standing for another node. Every
version arrives bit-exact against the unsharded model (built and trained without FSDP).
"""

from __future__ import annotations

import fsdp2_workers as f
import pytest
import weightsync_dist_workers as w

from rlfleet.weightsync import checksum


@pytest.mark.timeout(300)
def test_fsdp2_trainer_streams_bit_exact_to_engines_on_this_and_another_node() -> None:
    results = w.run_ranks(f.scenario_fsdp2_pipeline, 4, 3, 8 * 1024, timeout=260.0)
    assert results[0]["sharded"] is True
    assert results[1]["sharded"] is True
    assert results[0]["buckets"] > 4  # small buckets: stacked weights span buckets
    for rank in (2, 3):  # 2: same node (staged), 3: across the broadcast (stream)
        for version in (1, 2, 3):
            got = results[rank][f"v{version}"]
            assert got["version"] == version
            assert got["bit_exact"], (rank, version)
            assert got["finalized"] == version
    # the unsharded reference, built here: version 1 is the initial weights, untouched by training
    engine_v1 = dict(f.apply_transforms(f.engine_transforms(), f.reference(1).items()))
    assert results[2]["v1"]["checksum"] == checksum(engine_v1)
    assert results[3]["v1"]["checksum"] == checksum(engine_v1)
    assert results[2]["v3"]["checksum"] == results[3]["v3"]["checksum"]
    assert results[2]["v3"]["checksum"] != results[2]["v2"]["checksum"]  # training moved the weights


@pytest.mark.timeout(300)
def test_fsdp2_sender_peak_memory_is_a_bucket_and_a_parameter_not_the_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 0's peak extra resident memory (VmHWM after a reset, less the node buffer's shared
    pages) while streaming, against gathering the whole state dict first."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed tensors go back to the kernel
    sizes = {"layers": 6, "hidden": 512, "kv": 128, "inter": 1024}
    bucket = 2 << 20
    results = w.run_ranks(f.scenario_fsdp2_memory, 2, bucket, sizes, timeout=260.0)
    r = results[0]
    assert r["bit_exact"]
    assert r["model_bytes"] > 8 * (r["bucket_bytes"] + r["largest"])
    print(
        f"model {r['model_bytes'] / 2**20:.1f} MiB, bucket {r['bucket_bytes'] / 2**20:.1f} MiB, "
        f"largest parameter {r['largest'] / 2**20:.2f} MiB; rank 0 peak extra: streamed "
        f"{r['streamed'] / 2**20:.1f} / {r['streamed_again'] / 2**20:.1f} MiB, materialized "
        f"{r['materialized'] / 2**20:.1f} MiB; rank 1 (gathers only) {results[1]['streamed'] / 2**20:.1f} MiB"
    )
    # streaming holds about one bucket and one gathered parameter; the baseline holds the model
    assert r["materialized"] > 0.9 * r["model_bytes"]
    for key in ("streamed", "streamed_again"):
        assert r[key] < 2 * r["bucket_bytes"] + 2 * r["largest"], (key, r)
