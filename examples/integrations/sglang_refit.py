"""SGLang recipe: refit an SGLang ``Engine`` from rlfleet buckets. Not run in CI (no SGLang, no
GPU here); type-checked against `engines.py`.

Two paths, as SGLang offers them:

1. ``update_weights_from_tensor`` (the engine's process receives): any rlfleet transport lands
   buckets in the process that owns the ``Engine`` (a `BroadcastReceiver` for a trainer on
   another node, `SharedBufferReader.copy_version` for one on this node, a `CudaIpcReceiver` on
   the GPU). `sglang_bucket_consumer` hands each landed bucket to SGLang in its own
   flattened-bucket format (``load_format="flattened_bucket"``): the bucket *is* the flat tensor
   (a typed view, one per dtype in it; `weightsync.engines.flattened_bucket`), so nothing is
   re-packed, and SGLang's model runner rebuilds each weight as a view of it. One engine call
   per bucket, the radix cache flushed once per version:

       consumer = sglang_bucket_consumer(engine, layout, tp_size=2)   # a weightsync BucketConsumer
       BroadcastReceiver(layout, group, 0).receive(consumer, deadline=300)

   `sglang_consumer` is the same with SGLang's default format (named tensors, serialized by
   SGLang one by one) and rlfleet's transforms (rename, cast) in between.

2. ``update_weights_from_distributed`` (SGLang's own NCCL group receives): the trainer joins the
   group SGLang made with ``init_weights_update_group`` and `push_distributed` walks the rlfleet
   layout bucket by bucket: one engine call per bucket (names, dtypes, shapes), while the
   trainer broadcasts that bucket's tensors, each wait bounded by the deadline. The tensors come
   from any stream, e.g. `weightsync.full_tensors(fsdp_model)` (one parameter gathered at a
   time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist
from engines import SglangEngine

from rlfleet.weightsync import (
    Deadline,
    Layout,
    LayoutMismatchError,
    LoadWeightsConsumer,
    WeightTransform,
    dtype_name,
)
from rlfleet.weightsync.engines import SglangBucketConsumer


def sglang_bucket_consumer(
    engine: SglangEngine,
    layout: Layout,
    *,
    tp_size: int,
    mode: Literal["staged", "stream"] = "staged",
    rename_prefix: tuple[str, str] | None = None,
    serialize: Callable[[Any], Any] | None = None,
) -> SglangBucketConsumer:
    """A BucketConsumer feeding SGLang's flattened-bucket ``update_weights_from_tensor``.

    `serialize` is SGLang's ``MultiprocessingSerializer.serialize`` (the default, imported from
    SGLang): one payload per tensor-parallel rank (`tp_size`), as SGLang's engine expects them
    with ``load_format="flattened_bucket"``. "staged" (default): the engine gets the version only
    once every bucket arrived; "stream": each bucket as it lands (no staging copy; a version
    that fails after the first bucket leaves the engine partly loaded, `PartialLoadError`).
    """
    if serialize is None:
        from sglang.srt.utils import MultiprocessingSerializer  # type: ignore[import-not-found]

        serialize = MultiprocessingSerializer.serialize
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be an int >= 1, got {tp_size!r}")
    encode = serialize

    def update(payload: dict[str, Any]) -> Any:
        per_rank = [encode(payload) for _ in range(tp_size)]
        return engine.update_weights_from_tensor(per_rank, load_format="flattened_bucket", flush_cache=False)

    rename = None
    if rename_prefix is not None:
        old, new = rename_prefix

        def rename(name: str) -> str:
            return new + name[len(old) :] if name.startswith(old) else name

    return SglangBucketConsumer(layout, update, flush=engine.flush_cache, mode=mode, rename=rename)


def sglang_consumer(
    engine: SglangEngine,
    layout: Layout,
    *,
    mode: Literal["staged", "stream"] = "stream",
    transforms: Iterable[WeightTransform] = (),
) -> LoadWeightsConsumer:
    """A BucketConsumer feeding `engine.update_weights_from_tensor`.

    "stream" (default): one engine call per landed bucket, no staging copy; a version that
    fails mid-way leaves the engine partly loaded and says so (`PartialLoadError`, "stream").
    "staged": the engine gets the version only once every bucket arrived (one staging copy).
    """

    def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:
        result = engine.update_weights_from_tensor(list(weights), flush_cache=False)
        _check(result, "update_weights_from_tensor")
        return result

    return LoadWeightsConsumer(
        layout, load_weights, finalize=engine.flush_cache, mode=mode, transforms=list(transforms)
    )


def _check(result: Any, what: str) -> None:
    """SGLang answers (success, message) (or an object with .success): raise on failure."""
    success, message = (
        (result[0], result[1])
        if isinstance(result, tuple)
        else (
            getattr(result, "success", True),
            getattr(result, "message", ""),
        )
    )
    if not success:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def push_distributed(
    engine: SglangEngine,
    layout: Layout,
    weights: Iterable[tuple[str, torch.Tensor]],
    group: Any,
    group_name: str = "weight_update_group",
    timeout_s: float = 300.0,
) -> None:
    """Trainer side of ``update_weights_from_distributed``, bucket by bucket (see module doc).

    `group` is the trainer's handle on the group SGLang joined through
    ``init_weights_update_group`` (the trainer is its rank 0); `weights` yields the layout's
    tensors in layout order.
    """
    deadline = Deadline(timeout_s)
    stream = iter(weights)
    with ThreadPoolExecutor(1) as pool:
        for bucket in layout.buckets:
            specs = bucket.tensors
            receiving = pool.submit(
                engine.update_weights_from_distributed,
                [s.name for s in specs],
                [s.dtype for s in specs],
                [list(s.shape) for s in specs],
                group_name,
                False,  # flush the cache once, after the last bucket
            )
            for spec in specs:
                name, tensor = next(stream)
                got = (name, tuple(tensor.shape), dtype_name(tensor.dtype))
                if got != (spec.name, spec.shape, spec.dtype):
                    raise LayoutMismatchError(
                        f"stream gave {name!r} {dtype_name(tensor.dtype)} {tuple(tensor.shape)} where the "
                        f"layout has {spec.name!r} {spec.dtype} {spec.shape}",
                        name,
                    )
                work = dist.broadcast(tensor.contiguous(), src=0, group=group, async_op=True)
                work.wait(timeout=timedelta(seconds=deadline.remaining_or(timeout_s)))
            _check(receiving.result(timeout=deadline.remaining()), "update_weights_from_distributed")
    engine.flush_cache()
