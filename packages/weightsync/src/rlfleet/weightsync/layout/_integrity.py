"""Checks that weights are what they should be.

`fingerprint` is the seed's cheap consistency check (per-parameter float32 L2 norms, compared
with a relative tolerance); `checksum` is exact (a hash of every byte, dtype and shape), and
`bucket_checksum` guards a single bucket in flight.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import zlib
from collections.abc import Iterator, Mapping

import torch


@contextlib.contextmanager
def _host_bytes(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's bytes as a memoryview, zero-copy when it is a contiguous CPU tensor.

    Read through ctypes rather than ``.numpy()``: a numpy export marks the storage
    non-resizable for good, which would stop `offload_module` from freeing it later.
    """
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        yield memoryview(b"")
        return
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(flat.data_ptr())).cast("B")
    try:
        yield view  # `flat` stays referenced (and its memory alive) until the caller is done
    finally:
        view.release()
        del flat


def checksum(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Exact identity of a state dict: every name, dtype, shape and byte (key order ignored)."""
    digest = hashlib.blake2b(digest_size=32)
    for name in sorted(state_dict):
        tensor = state_dict[name]
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        with _host_bytes(tensor) as data:
            digest.update(data)
    return digest.hexdigest()


def bucket_checksum(buffer: torch.Tensor) -> int:
    """CRC32 of a bucket's bytes: catches corruption in flight, fast enough for every bucket."""
    with _host_bytes(buffer) as data:
        return zlib.crc32(data) & 0xFFFFFFFF


def fingerprint(state_dict: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per-parameter L2 norms in float32 (the seed's `get_param_fingerprint`)."""
    out: dict[str, float] = {}
    for name, tensor in state_dict.items():
        values = tensor.detach()
        if values.is_complex():
            values = values.abs()
        value = torch.linalg.vector_norm(values.to(torch.float32))
        out[name] = float(value)
    return out


def compare_fingerprints(
    reference: Mapping[str, float], other: Mapping[str, float], rtol: float = 1e-3
) -> list[str]:
    """Mismatches as sentences, with the seed's rule |t - e| / max(|t|, 1e-8) > rtol.

    Equal values match before any arithmetic: two identical infinities (a ``-inf`` mask buffer
    has an infinite norm) are equal, though ``inf - inf`` is NaN. NaN never matches.
    """
    problems: list[str] = []
    for name, ref in reference.items():
        if name not in other:
            problems.append(f"{name}: missing")
            continue
        value = other[name]
        if value == ref:
            continue
        rel = abs(ref - value) / max(abs(ref), 1e-8)
        if rel > rtol or rel != rel:  # NaN is a mismatch
            problems.append(f"{name}: reference={ref:.6g} got={value:.6g} rel_diff={rel:.2e}")
    problems.extend(f"{name}: unexpected" for name in other if name not in reference)
    return problems
