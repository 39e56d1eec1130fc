"""The chunked host passes of a delta against a plain torch reference, on buckets of several chunks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rlfleet.weightsync.codec import apply_delta, bucket_digest, encode_delta

# three chunks of 1 MiB and a partial 4 KiB row: every chunk boundary and the bucket's tail
NBYTES = 3 * (1 << 20) + 512


def _reference_digest(bucket: torch.Tensor) -> int:
    words = bucket.view(torch.int64)
    whole = words.numel() // 512 * 512
    sums = words[:whole].view(-1, 512).sum(1)
    if whole < words.numel():
        sums = torch.cat([sums, words[whole:].sum().view(1)])
    return int.from_bytes(hashlib.blake2b(sums.numpy().tobytes(), digest_size=8).digest(), "little")


def _pair(fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = (torch.randn(NBYTES // 2, generator=g) * 0.02).to(torch.bfloat16).view(torch.uint8)
    current = base.clone()
    picked = torch.randperm(NBYTES // 2, generator=g)[: int(fraction * NBYTES // 2)]
    current.view(torch.int16)[picked] += 1
    return base, current, picked.sort().values


# 0.05%: numpy's branchy nonzero; 2%: the padded branchless one; 8% and 30%: dense (bitmap)
@pytest.mark.parametrize("fraction", [0.0005, 0.02, 0.08, 0.3])
def test_chunked_encode_and_apply_equal_the_reference(fraction: float) -> None:
    base, current, picked = _pair(fraction, 1)
    kept = base.clone()
    payload = encode_delta(current, kept, 1.0, update=True)
    assert torch.equal(kept, current)  # the sender's base took exactly the changes
    assert payload.changed == picked.numel()
    assert payload.digest == _reference_digest(current) == bucket_digest(current)
    if payload.kind == "sparse":
        count = picked.numel()
        assert torch.equal(payload.data[16 : 16 + 4 * count].view(torch.int32).long(), picked)
    out = base.clone()
    assert apply_delta(payload.kind, payload.data, out) == picked.numel()
    assert torch.equal(out, current)
    assert bucket_digest(out) == payload.digest


def _rebuilt_digest(payload: torch.Tensor, base: torch.Tensor) -> int:
    out = base.clone()
    apply_delta("sparse", payload, out)
    return bucket_digest(out)


def test_a_torn_payload_or_a_stale_base_never_digests_as_the_senders() -> None:
    base, current, _ = _pair(0.02, 2)
    payload = encode_delta(current, base.clone())
    assert payload.kind == "sparse"
    assert _rebuilt_digest(payload.data, base) == payload.digest
    count = payload.changed
    index = payload.data[16 : 16 + 4 * count].view(torch.int32)
    swapped = payload.data.clone()  # two changes of different chunks swap places
    swapped[16 : 16 + 4 * count].view(torch.int32)[[10, count - 10]] = index[[count - 10, 10]]
    assert _rebuilt_digest(swapped, base) != payload.digest
    flipped = payload.data.clone()  # one value torn
    flipped[-1] ^= 1
    assert _rebuilt_digest(flipped, base) != payload.digest
    stale = base.clone()  # a receiver's base with one stale word in the last chunk
    stale.view(torch.int16)[-3] += 1
    assert _rebuilt_digest(payload.data, stale) != payload.digest
