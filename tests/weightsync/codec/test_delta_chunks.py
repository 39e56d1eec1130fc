"""The chunked host passes of a delta against a plain torch reference, on buckets of several chunks,
through the compiled loops (numba) and through numpy alike."""

from __future__ import annotations

import hashlib

import pytest
import torch

from rlfleet.weightsync import ChecksumMismatchError, DoubleBuffer, Layout, MetadataError, pack_bucket
from rlfleet.weightsync.codec import (
    apply_delta,
    apply_delta_digest,
    base_pieces_of,
    bucket_digest,
    encode_delta,
    native_codec,
    rebuild,
)
from rlfleet.weightsync.codec._delta_scan import base_filler  # private: the runs a rebuild takes

# three chunks of 1 MiB and a partial 4 KiB row: every chunk boundary and the bucket's tail
NBYTES = 3 * (1 << 20) + 512


@pytest.fixture(autouse=True, params=["native", "numpy"])
def host_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: the compiled loops (when numba is installed) and numpy's passes."""
    if request.param == "native" and not native_codec():
        pytest.skip("numba is not installed (the [native] extra)")
    if request.param == "numpy":
        monkeypatch.setattr("rlfleet.weightsync.codec._delta_scan.kernels", lambda: None)
    return str(request.param)


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
    if payload.kind != "full":
        out = base.clone()
        assert apply_delta_digest(payload.kind, payload.data, out) == (picked.numel(), payload.digest)
        assert torch.equal(out, current)


def _rebuilt_digest(payload: torch.Tensor, base: torch.Tensor) -> int:
    out = base.clone()
    digest = apply_delta_digest("sparse", payload, out)[1]
    assert digest == bucket_digest(out)  # the one-pass digest is the rebuilt bucket's
    return digest


def test_a_torn_payload_or_a_stale_base_never_digests_as_the_senders() -> None:
    base, current, _ = _pair(0.02, 2)
    payload = encode_delta(current, base.clone())
    assert payload.kind == "sparse"
    assert _rebuilt_digest(payload.data, base) == payload.digest
    count = payload.changed
    index = payload.data[16 : 16 + 4 * count].view(torch.int32)
    swapped = payload.data.clone()  # two changes of different chunks swap places: refused unread
    swapped[16 : 16 + 4 * count].view(torch.int32)[[10, count - 10]] = index[[count - 10, 10]]
    with pytest.raises(MetadataError, match="not increasing"):
        _rebuilt_digest(swapped, base)
    flipped = payload.data.clone()  # one value torn
    flipped[-1] ^= 1
    assert _rebuilt_digest(flipped, base) != payload.digest
    stale = base.clone()  # a receiver's base with one stale word in the last chunk
    stale.view(torch.int16)[-3] += 1
    assert _rebuilt_digest(payload.data, stale) != payload.digest


def test_a_rebuild_from_a_consumers_tensors_fills_padding_and_refuses_a_stale_one() -> None:
    """A DoubleBuffer offers its live tensors as the base (no copy of the bucket first): the
    rebuilt bucket equals the sender's, padding zeroed over landing-zone garbage; a live tensor
    that drifted makes the digest differ."""
    g = torch.Generator().manual_seed(3)
    shapes = {"embed": (1000, 700), "norm": (333,), "proj": (700, 1001), "bias": (7,)}
    before = {k: (torch.randn(s, generator=g) * 0.02).to(torch.bfloat16) for k, s in shapes.items()}
    after = {k: v.clone() for k, v in before.items()}
    for v in after.values():
        flat = v.view(-1).view(torch.int16)
        flat[torch.randperm(flat.numel(), generator=g)[: max(1, flat.numel() // 50)]] += 1
    layout = Layout.from_state_dict(before, 3 << 20)
    receiver = DoubleBuffer({k: v.clone() for k, v in before.items()}, layout)
    for b in layout.buckets:
        old, new = (torch.zeros(b.nbytes, dtype=torch.uint8) for _ in range(2))
        pack_bucket(layout, b.index, before, old)
        pack_bucket(layout, b.index, after, new)
        payload = encode_delta(new, old)
        assert payload.kind != "full"
        assert base_pieces_of(receiver, b.index) is not None
        out = torch.full((b.nbytes,), 0xAB, dtype=torch.uint8)  # what a landing zone held before
        rebuild(receiver, b.index, payload.kind, payload.data, out, payload.digest)
        assert torch.equal(out, new)
    receiver.live["proj"].view(-1)[12345] += 1  # the receiver's base is no longer the sender's
    proj = layout["proj"].bucket
    old, new = (torch.zeros(layout.buckets[proj].nbytes, dtype=torch.uint8) for _ in range(2))
    pack_bucket(layout, proj, before, old)
    pack_bucket(layout, proj, after, new)
    payload = encode_delta(new, old)
    with pytest.raises(ChecksumMismatchError, match="another base"):
        rebuild(receiver, proj, payload.kind, payload.data, torch.empty_like(new), payload.digest)


def test_base_runs_cover_the_range_and_copy_only_whole_rows_of_one_piece() -> None:
    """The runs a rebuild takes from its base: in order, covering the range; a run with a
    source holds whole 4 KiB rows inside one piece (or ends the bucket) and is that piece's
    bytes; the rest (piece edges, gaps) is filled."""
    nbytes = 5 * 4096 + 512
    pieces = [(100, torch.arange(9000) % 251), (9100, torch.arange(11000) % 13)]
    pieces = [(at, p.to(torch.uint8)) for at, p in pieces]
    out = torch.full((nbytes,), 0xAB, dtype=torch.uint8)
    filler = base_filler(pieces, out.numpy())
    expected = torch.zeros(nbytes, dtype=torch.uint8)
    for at, p in pieces:
        expected[at : at + p.numel()] = p
    for start, end in [(0, nbytes), (4096, 3 * 4096), (2 * 4096, nbytes)]:
        runs = filler.runs(start, end)
        assert [a for a, _, _ in runs] == [start, *(b for _, b, _ in runs[:-1])]
        assert runs[-1][1] == end
        copied = [(a, b, s) for a, b, s in runs if s is not None]
        assert copied, "a whole row inside a piece is copied by the rebuild"
        for a, b, source in copied:
            assert a % 4096 == 0
            assert b % 4096 == 0 or b == nbytes
            assert bytes(source.view("u1")) == bytes(expected[a:b].numpy())
        out.fill_(0xAB)
        for a, b, source in runs:
            if source is None:
                filler(a, b)
            else:
                out[a:b] = torch.from_numpy(source.view("u1"))
        assert torch.equal(out[start:end], expected[start:end])
