"""A bucket of version v as its difference from the same bucket of a base version b.

Compared bit for bit in 2-byte words of the wire bytes (a bf16 or fp16 element each; an fp32
element is two words, an fp8 pair one), so what a receiver rebuilds is exactly the sender's
bytes, whatever the dtypes in the bucket. Two encodings, chosen per bucket by size, both
computed from the count of changed words before anything is written:

- ``sparse``: the changed words' indices (int32) then their new values: 6 bytes per change;
- ``bitmap``: one bit per word then the new values: 1/16 of the bucket plus 2 bytes per change,
  smaller once more than 1 word in 32 changed, and picked once it is half the size (its decode
  scans every word, ``sparse``'s only the changes).

A bucket whose delta is not smaller than ``max_fraction`` of its full size travels ``full``.
Measured on fp32 AdamW weights synced as bf16 (`benchmarks/delta.py`), about 1% of the words
change per step at lr 1e-6, so ``sparse`` wins; general-purpose compressors on the XOR gain
little on top of that and cost a pass of their own, so none is used.

`bucket_digest` is what a receiver checks the rebuilt bucket against: a delta applied to the
wrong base (a receiver that restarted, missed a version or holds corrupted bytes) is refused,
never applied. It is a blake2b of the wrapping int64 sums of each 4 KiB row: one pass at
memory speed (a CRC32 of the whole model costs three memcpys here), and any change of a row's
sum, which every torn, stale or foreign byte makes but for a 2**-64 chance, changes it (bytes
swapped within a row keep its sum: a reordering, which no failure here produces).

On the host the sender sweeps a bucket once, in cache-sized chunks shared among the copy
threads (`_delta_scan`): compare, refine, update its base and sum the digest rows per chunk; a
receiver copies its base, writes the changes and sums its rows in one pass the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.codec._delta_scan import (
    ROW_WORDS,
    BasePieces,
    apply_changes,
    base_filler,
    digest_of_sums,
    scan_changes,
)
from rlfleet.weightsync.layout._copy import default_copy_threads, map_threads

__all__ = [
    "DEFAULT_MAX_FRACTION",
    "DELTA_KINDS",
    "DeltaPayload",
    "apply_delta",
    "apply_delta_digest",
    "bucket_digest",
    "encode_delta",
]

#: A bucket whose delta is at least this fraction of its full bytes is sent full.
DEFAULT_MAX_FRACTION = 0.5
FULL, SPARSE, BITMAP = "full", "sparse", "bitmap"
DELTA_KINDS = (FULL, SPARSE, BITMAP)
_HEAD = 16  # count (int64) and word count (int64)
_ROW = ROW_WORDS
#: ``bitmap`` is picked only when at most this fraction of ``sparse``'s bytes: its decode scans
#: every word of the bucket, ``sparse``'s only the changes.
BITMAP_PREFERENCE = 0.5


@dataclass(frozen=True)
class DeltaPayload:
    """What travels for one bucket: its kind, its bytes, what changed, and the new bytes' digest."""

    kind: str
    #: The bytes on the wire: the full bucket, or the encoded delta (flat uint8).
    data: torch.Tensor
    #: 2-byte words that differ from the base (every word for a full bucket without a base).
    changed: int
    #: `bucket_digest` of the bucket's new bytes (0 when nobody checks it: a full bucket).
    digest: int

    @property
    def nbytes(self) -> int:
        return int(self.data.numel())


def _words(bucket: torch.Tensor, what: str) -> int:
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() % 512:
        raise ValueError(f"{what} must be flat uint8 bytes, a multiple of 512, got {tuple(bucket.shape)}")
    return bucket.numel() // 2


def bucket_digest(bucket: torch.Tensor) -> int:
    """A 64-bit digest of a bucket's bytes (flat uint8, a multiple of 512 bytes; see the module)."""
    _words(bucket, "a digested bucket")
    words = bucket.view(torch.int64)
    whole = words.numel() // _ROW * _ROW
    sums = words[:whole].view(-1, _ROW).sum(1)
    if whole < words.numel():
        sums = torch.cat([sums, words[whole:].sum().view(1)])
    return digest_of_sums([sums.cpu().numpy()])


Pieces = list[tuple[Any, Any]]


@contextlib.contextmanager
def _changed_words(current: torch.Tensor, base: torch.Tensor, update: bool) -> Iterator[tuple[Pieces, int]]:
    """The 2-byte words of `current` that differ from `base`, as (indices, int16 values) pieces in
    order (numpy per share on the host, valid inside the ``with`` only; one torch pair on a
    GPU), and the digest of `current`; `base` takes the changes when `update`.

    Coarse first: 8-byte words compared at memory speed, then the few that differ split in four
    (on the host in cache-sized chunks, `_delta_scan`).
    """
    cur64, base64 = current.view(torch.int64), base.view(torch.int64)
    if current.is_cpu:
        with scan_changes(cur64.numpy(), base64.numpy(), update) as chunks:
            yield [(c[0], c[1]) for c in chunks], digest_of_sums([c[2] for c in chunks])
        return
    digest = bucket_digest(current)
    coarse = torch.ne(cur64, base64).nonzero().view(-1)
    new = cur64.index_select(0, coarse).view(torch.int16)
    fine = torch.ne(new, base64.index_select(0, coarse).view(torch.int16)).nonzero().view(-1)
    index, values = coarse.index_select(0, fine // 4) * 4 + fine % 4, new.index_select(0, fine)
    if update:
        base.view(torch.int16).index_copy_(0, index, values)
    yield [(index, values)], digest


def _write_pieces(pieces: Pieces, index_out: torch.Tensor | None, values_out: torch.Tensor) -> None:
    """Each piece's indices (as int32) and values into their place in the payload, in order
    (host pieces on the copy threads: the payload's fresh pages fault in parallel)."""
    starts = np.cumsum([0] + [len(v) for _, v in pieces]).tolist()

    def write(i: int) -> None:
        (index, values), at, end = pieces[i], starts[i], starts[i + 1]
        if isinstance(values, np.ndarray):
            np.copyto(values_out[at:end].numpy(), values)
            if index_out is not None:
                np.copyto(index_out[at:end].numpy(), index, casting="unsafe")
        else:
            values_out[at:end].copy_(values)
            if index_out is not None:
                index_out[at:end].copy_(index)

    if pieces and isinstance(pieces[0][1], np.ndarray):
        threads = max(1, min(len(pieces), default_copy_threads()))

        def share(t: int) -> None:
            for i in range(t, len(pieces), threads):
                write(i)

        map_threads(share, threads)
    else:
        for i in range(len(pieces)):
            write(i)


def _index_array(pieces: Pieces) -> np.ndarray:
    parts = [i if isinstance(i, np.ndarray) else i.cpu().numpy() for i, _ in pieces]
    return np.concatenate(parts) if parts else np.empty(0, np.int64)


def encode_delta(
    current: torch.Tensor,
    base: torch.Tensor,
    max_fraction: float = DEFAULT_MAX_FRACTION,
    *,
    update: bool = False,
) -> DeltaPayload:
    """Bucket `current` against `base` (same size and device, flat uint8): the smaller encoding,
    or ``full`` (`current` itself, no copy) when no delta is below ``max_fraction`` of it.

    ``update=True`` then writes the changed words into `base`, which becomes `current` (a
    scatter of the few changes, not a copy of the bucket).
    """
    words = _words(current, "a bucket")
    if base.shape != current.shape or base.dtype != torch.uint8 or base.device != current.device:
        raise ValueError(
            f"base bucket is {tuple(base.shape)} on {base.device}, the bucket {tuple(current.shape)} "
            f"on {current.device}"
        )
    with _changed_words(current, base, update) as (pieces, digest):
        return _encoded(current, words, pieces, digest, max_fraction)


def _encoded(
    current: torch.Tensor, words: int, pieces: Pieces, digest: int, max_fraction: float
) -> DeltaPayload:
    """The payload of `pieces` (`encode_delta`'s choice of encoding), written while they are valid."""
    count = sum(len(v) for _, v in pieces)
    sparse = _HEAD + _pad8(4 * count) + 2 * count
    bitmap = _HEAD + _pad8(-(-words // 8)) + 2 * count
    use_bitmap = bitmap <= BITMAP_PREFERENCE * sparse
    best = bitmap if use_bitmap else sparse
    if best >= max_fraction * current.numel() or words >= 2**31:
        return DeltaPayload(FULL, current, count, digest)
    out = torch.empty(best, dtype=torch.uint8, device=current.device)
    out[:_HEAD].view(torch.int64).copy_(torch.tensor([count, words], dtype=torch.int64))
    body = out[_HEAD:]
    if not use_bitmap:
        body[4 * count : _pad8(4 * count)].zero_()
        _write_pieces(pieces, body[: 4 * count].view(torch.int32), body[_pad8(4 * count) :].view(torch.int16))
        return DeltaPayload(SPARSE, out, count, digest)
    mask = np.zeros(words, dtype=np.bool_)
    mask[_index_array(pieces)] = True
    bits = torch.from_numpy(np.packbits(mask, bitorder="little"))
    body[: bits.numel()].copy_(bits)
    body[bits.numel() : _pad8(bits.numel())].zero_()
    _write_pieces(pieces, None, body[_pad8(bits.numel()) :].view(torch.int16))
    return DeltaPayload(BITMAP, out, count, digest)


def _pad8(n: int) -> int:
    return (n + 7) // 8 * 8


def _header(payload: torch.Tensor, words: int, kind: str) -> int:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or payload.numel() < _HEAD:
        raise MetadataError(f"{kind} delta payload is {payload.numel()} bytes, shorter than its header")
    count, total = (int(v) for v in payload[:_HEAD].cpu().view(torch.int64).tolist())
    if total != words or not 0 <= count <= words:
        raise MetadataError(
            f"{kind} delta covers {total} words with {count} changes; the bucket has {words} words"
        )
    return count


def _decode(kind: str, payload: torch.Tensor, words: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The changed words' indices (sorted, int32 or int64) and values (int16) of a payload."""
    count = _header(payload, words, kind)
    body = payload[_HEAD:]
    if kind == SPARSE:
        need = _pad8(4 * count) + 2 * count
        if body.numel() != need:
            raise MetadataError(f"sparse delta of {count} changes is {body.numel()} bytes, expected {need}")
        return body[: 4 * count].view(torch.int32), body[_pad8(4 * count) :].view(torch.int16)
    if kind == BITMAP:
        nbits = _pad8(-(-words // 8))
        if body.numel() != nbits + 2 * count:
            raise MetadataError(f"bitmap delta is {body.numel()} bytes, expected {nbits + 2 * count}")
        bits = body[: -(-words // 8)].cpu().numpy()
        index = torch.from_numpy(np.flatnonzero(np.unpackbits(bits, count=words, bitorder="little")))
        if int(index.numel()) != count:
            raise MetadataError(f"bitmap delta marks {index.numel()} words but carries {count} values")
        return index, body[nbits:].view(torch.int16)
    raise MetadataError(f"unknown delta kind {kind!r}; known: {list(DELTA_KINDS[1:])}")


def _apply(
    kind: str, payload: torch.Tensor, out: torch.Tensor, base: BasePieces | None = None
) -> tuple[int, list[np.ndarray] | None]:
    """Write the changes into `out` (holding the base, or filled from `base` chunk by chunk); on
    the host also the row sums of the result (one pass)."""
    words = _words(out, "a rebuilt bucket")
    index, values = _decode(kind, payload, words)
    if out.is_cpu:
        fill = base_filler(base, out.numpy()) if base is not None else None
        sums = apply_changes(out.view(torch.int64).numpy(), index.cpu().numpy(), values.cpu().numpy(), fill)
        return int(index.numel()), sums
    if base is not None:
        raise ValueError("base pieces are for a host rebuild; a device rebuild copies its base first")
    index = index.to(out.device, torch.int64)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= words):
        raise MetadataError(f"sparse delta names a word outside the bucket's {words}")
    out.view(torch.int16).index_copy_(0, index, values.to(out.device))
    return int(index.numel()), None


def apply_delta(kind: str, payload: torch.Tensor, out: torch.Tensor) -> int:
    """Write the changes of a ``sparse`` or ``bitmap`` `payload` into `out` (which holds the base).

    Returns the number of changed words; a payload that does not fit `out` is a `MetadataError`
    (`out` may then be written in part: it is a landing zone nobody commits on an error).
    """
    return _apply(kind, payload, out)[0]


def apply_delta_digest(
    kind: str, payload: torch.Tensor, out: torch.Tensor, base: BasePieces | None = None
) -> tuple[int, int]:
    """`apply_delta`, and the `bucket_digest` of the result: on the host summed in the same pass,
    each row while its changes are in cache. With `base` (``DeltaBase.base_pieces``, host
    tensors) each row of `out` is first copied from the base in that pass: no separate copy."""
    count, sums = _apply(kind, payload, out, base)
    return count, (digest_of_sums(sums) if sums is not None else bucket_digest(out))
