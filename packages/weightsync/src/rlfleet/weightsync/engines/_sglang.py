"""SGLang's flattened-bucket refit, fed straight from rlfleet's buckets (no re-pack copy).

SGLang's ``Engine.update_weights_from_tensor(named_tensors, load_format="flattened_bucket",
flush_cache=...)`` takes, per tensor-parallel rank, one serialized ``{"flattened_tensor": t,
"metadata": [FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel), ...]}``;
the model runner rebuilds each weight as ``t[start_idx:end_idx].reshape(shape)`` (a view) and
hands them to ``load_weights`` (``python/sglang/srt/weight_sync/tensor_bucket.py``,
``FlattenedTensorBucket.reconstruct_tensors``; ``python/sglang/srt/entrypoints/engine.py``).

An rlfleet bucket is already such a flat tensor: each tensor sits at an offset that is a
multiple of its element size, and the bucket is a multiple of 512 bytes. `flattened_bucket`
therefore returns typed views of the landed bucket itself (one payload per dtype in the
bucket: the whole bucket viewed as that dtype, with the metadata of that dtype's tensors), and
`SglangBucketConsumer` hands every landed bucket to the engine that way, where other recipes
``torch.cat`` the tensors into a new bucket first.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import MetadataError, PartialLoadError
from rlfleet.weightsync.buffers._buffers import BufferBase
from rlfleet.weightsync.layout._dtypes import dtype_from_name
from rlfleet.weightsync.layout._layout import Layout, TensorSpec

__all__ = ["FlattenedTensorMeta", "SglangBucketConsumer", "flattened_bucket", "sglang_meta_class"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlattenedTensorMeta:
    """SGLang's ``FlattenedTensorMetadata`` (same fields), for when SGLang is not importable."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def sglang_meta_class() -> Any:
    """SGLang's own metadata class when SGLang is importable (its processes unpickle it), else ours."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import (  # type: ignore[import-not-found]
            FlattenedTensorMetadata,
        )
    except ImportError:
        return FlattenedTensorMeta
    return FlattenedTensorMetadata


def flattened_bucket(
    layout: Layout,
    index: int,
    data: torch.Tensor,
    *,
    rename: Callable[[str], str] | None = None,
    meta_class: Any = FlattenedTensorMeta,
) -> list[dict[str, Any]]:
    """SGLang flattened-bucket payloads for bucket `index`, landed as the bytes `data`.

    One payload per dtype present in the bucket; each ``flattened_tensor`` is a view of `data`
    (no copy), each metadata entry indexes it in elements of that dtype. `rename` maps the
    trainer's names onto what the engine's ``load_weights`` reads.
    """
    buckets = layout.buckets
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(buckets):
        raise MetadataError(f"bucket {index!r} does not exist (layout has {len(buckets)})")
    bucket = buckets[index]
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != bucket.nbytes:
        raise MetadataError(
            f"bucket {index} must be {bucket.nbytes} flat uint8 bytes, got {data.dtype} {tuple(data.shape)}"
        )
    groups: dict[str, list[TensorSpec]] = {}
    for spec in bucket.tensors:
        groups.setdefault(spec.dtype, []).append(spec)
    payloads = []
    for dtype_key, specs in groups.items():
        dtype = dtype_from_name(dtype_key)
        size = torch.empty((), dtype=dtype).element_size()
        flat = data[: bucket.nbytes - bucket.nbytes % size].view(dtype)
        metadata = [
            meta_class(
                name=spec.name if rename is None else rename(spec.name),
                shape=torch.Size(spec.shape),
                dtype=dtype,
                start_idx=spec.offset // size,
                end_idx=spec.offset // size + spec.numel,
                numel=spec.numel,
            )
            for spec in specs
        ]
        payloads.append({"flattened_tensor": flat, "metadata": metadata})
    return payloads


def _failure(result: Any) -> str | None:
    """SGLang answers ``(success, message)`` (or an object with ``.success``): the message on failure."""
    if isinstance(result, tuple) and len(result) >= 2:
        return None if result[0] else str(result[1])
    if getattr(result, "success", True):
        return None
    return str(getattr(result, "message", result))


class SglangBucketConsumer(BufferBase):
    """A `BucketConsumer` that refits SGLang with one flattened-bucket call per landed bucket.

    `update(payload)` makes one ``update_weights_from_tensor(..., load_format="flattened_bucket",
    flush_cache=False)`` call (serializing `payload` once per tensor-parallel rank) and returns
    SGLang's answer; `flush` runs once per version. "staged" (default): buckets land in a
    staging copy and reach the engine only at commit; "stream": each bucket goes to the engine as
    it lands (no staging memory; a failed version leaves it partly loaded, `PartialLoadError`).
    """

    def __init__(
        self,
        layout: Layout,
        update: Callable[[dict[str, Any]], Any],
        *,
        flush: Callable[[], Any] | None = None,
        mode: Literal["staged", "stream"] = "staged",
        rename: Callable[[str], str] | None = None,
        meta_class: Any = None,
        device: str | torch.device = "cpu",
    ) -> None:
        if mode not in ("staged", "stream"):
            raise ValueError(f"SglangBucketConsumer mode must be 'staged' or 'stream', got {mode!r}")
        super().__init__(layout)
        self.update, self.flush, self.mode, self.rename = update, flush, mode, rename
        self.meta_class = sglang_meta_class() if meta_class is None else meta_class
        self.device = torch.device(device)
        self.torn = False
        self.calls = 0
        self._staging: torch.Tensor | None = None

    def _begin(self, version: int) -> None:
        if self.mode == "staged":
            self._staging = torch.empty(self._layout.padded_bytes, dtype=torch.uint8, device=self.device)

    def bucket_target(self, index: int) -> torch.Tensor | None:
        """Staged mode: where bucket `index` of the pending version may be written directly."""
        with self._state_lock:
            if self._pending is None or self._staging is None or not 0 <= index < len(self._layout.buckets):
                return None
            start = self._starts[index]
            return self._staging[start : start + self._layout.buckets[index].nbytes]

    def _stage(self, index: int, data: torch.Tensor) -> None:
        if self.mode == "stream":
            assert self._pending is not None
            self._send(self._pending, index, data)
            return
        region = self.bucket_target(index)
        assert region is not None
        if region.data_ptr() != data.data_ptr():
            region.copy_(data)

    def _send(self, version: int, index: int, data: torch.Tensor) -> None:
        for payload in flattened_bucket(
            self._layout, index, data, rename=self.rename, meta_class=self.meta_class
        ):
            self.torn = True  # the engine may hold part of this version from here on
            self.calls += 1
            try:
                failure = _failure(self.update(payload))
            except Exception as exc:
                failure = f"{type(exc).__name__}: {exc}"
            if failure is not None:
                raise PartialLoadError(
                    f"SGLang update_weights_from_tensor failed on bucket {index} of version {version} "
                    f"(mode {self.mode!r}): {failure}; the engine may hold part of it and must be reloaded",
                    version=version,
                    mode=self.mode,
                )

    def _prepare(self, version: int, deadline: Deadline) -> None:
        deadline.check(f"preparing version {version} for SGLang")

    def _publish(self, version: int) -> None:
        if self.mode == "staged":
            for index in range(len(self._layout.buckets)):
                region = self.bucket_target(index)
                assert region is not None
                self._send(version, index, region)
        if self.flush is not None:
            self.flush()
        self.torn = False
        self.last_error = None
        self._staging = None

    def _drop(self) -> None:
        self._staging = None
        if self.torn:
            _log.error(
                "SglangBucketConsumer: version %s left the engine partly loaded: %s",
                self._pending,
                self.last_error,
            )
