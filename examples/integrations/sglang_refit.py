"""SGLang recipe: refit an SGLang ``Engine`` from rlfleet buckets. Not run in CI (no SGLang, no
GPU here); type-checked against `engines.py`.

Two paths, as SGLang offers them:

1. ``update_weights_from_tensor`` (the engine's process receives): any rlfleet transport lands
   buckets in the process that owns the ``Engine`` (a `BroadcastReceiver` for a trainer on
   another node, `SharedBufferReader.copy_version` for one on this node); `sglang_consumer` turns
   each landed bucket into one ``update_weights_from_tensor`` call (bucketed refit, not one call
   per parameter) and flushes the radix cache once per version:

       consumer = sglang_consumer(engine, layout)               # a weightsync BucketConsumer
       BroadcastReceiver(layout, group, 0).receive(consumer, deadline=300)

2. ``update_weights_from_distributed`` (SGLang's own NCCL group receives): the trainer joins the
   group SGLang made with ``init_weights_update_group`` and `push_distributed` walks the rlfleet
   layout bucket by bucket: one engine call per bucket (names, dtypes, shapes), while the
   trainer broadcasts that bucket's tensors, each wait bounded by the deadline. The tensors come
   from any stream, e.g. `weightsync.full_tensors(fsdp_model)` (one parameter gathered at a
   time).
"""

from __future__ import annotations

from collections.abc import Iterable
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
