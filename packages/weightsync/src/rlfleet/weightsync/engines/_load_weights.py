"""A receiver that feeds an inference engine through its model's ``load_weights``.

vLLM's and SGLang's model classes take new weights as
``load_weights(weights: Iterable[tuple[str, torch.Tensor]])`` (the engine copies each tensor
into its own parameter, splitting or stacking as it needs), and some need a post-processing
step once a version is loaded (vLLM's ``process_weights_after_loading``: repacking, scales).
`LoadWeightsConsumer` is the `BucketConsumer` for such an engine: any transport drives it, the
`transforms` (rename, fuse, cast) run between the wire and the engine, and `finalize` runs once
per version.

An engine's ``load_weights`` writes in place and cannot roll back, so the two modes differ in
what a failure costs:

- ``"staged"`` (default): buckets land in a staging copy; the engine is fed only at `commit`,
  after every bucket of the version arrived and every receiver voted OK. A failed transfer
  leaves the engine untouched on its previous version. Costs one copy of the wire bytes while
  a version is pending. Only an error inside ``load_weights``/``finalize`` itself can leave the
  engine partly loaded: `commit` then raises `PartialLoadError` (mode "staged").
- ``"stream"``: each bucket is fed as it lands (no staging memory). A version that fails after
  the first bucket was fed leaves the engine partly loaded: the error handed to `abort` is
  recorded as a `PartialLoadError` (mode "stream") in `last_error`, `torn` is set, it is logged
  and `on_partial` is called, so the engine is told. The next complete version repairs it.
  Some engines write into the tensors they are handed (an in-place scale or permutation), and a
  transport may land a bucket in memory the receiver must not write (`lent`: a read-only
  shared-memory mapping of ShmRing, the node buffer's `copy_version` or CUDA IPC host slots,
  where a write is SIGSEGV; another process's IPC slot on a GPU). Such a bucket is copied into
  a private buffer of its own first (`copied_bytes`; a fresh one per bucket, as a loader may
  keep what it was handed until a later call), one more copy of the wire bytes (512 MiB from a
  node buffer into a load_weights that copies each tensor into its parameters: 0.63 s instead
  of 0.32 s on the 2-core box). ``writes_inputs=False`` says the engine never writes them and
  skips that copy.

Either way a partly loaded engine is never reported as holding a version: `version` moves only
when ``load_weights`` and ``finalize`` both returned. The transport's receive raises its own
error (`SyncAbortedError`, `PeerLostError`, ...), never the `PartialLoadError`: that one is in
`last_error` and reaches `on_partial`. `last_error` is the error of the last failed version and
is cleared (None) once a later version is applied whole, so a stale error never outlives the
repair.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import LayoutMismatchError, PartialLoadError, WeightSyncError
from rlfleet.weightsync.buffers._buffers import BufferBase
from rlfleet.weightsync.engines._transforms import TransformChain, WeightTransform, plan_transforms
from rlfleet.weightsync.layout._dtypes import dtype_name
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._lent import lent
from rlfleet.weightsync.layout._packing import bucket_views, flat_views

__all__ = ["LoadWeights", "LoadWeightsConsumer"]

_log = logging.getLogger(__name__)

#: The engine-side contract (vLLM / SGLang model classes): takes (name, tensor) pairs.
LoadWeights = Callable[[Iterable[tuple[str, torch.Tensor]]], Any]

Entry = tuple[str, tuple[int, ...], str]
Expected = Mapping[str, torch.Tensor] | Iterable[tuple[str, Sequence[int], str | torch.dtype]]


def _expected_entries(expected: Expected) -> dict[str, tuple[tuple[int, ...], str]]:
    if isinstance(expected, Mapping):
        return {name: (tuple(t.shape), dtype_name(t.dtype)) for name, t in expected.items()}
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape, dtype in expected:
        out[name] = (tuple(shape), dtype if isinstance(dtype, str) else dtype_name(dtype))
    return out


def _check_against(plan: list[Entry], expected: Mapping[str, tuple[tuple[int, ...], str]]) -> None:
    """Raise LayoutMismatchError naming the first weight the engine would not take as given."""
    produced = {name: (shape, dtype) for name, shape, dtype in plan}
    for name, (shape, dtype) in produced.items():
        want = expected.get(name)
        if want is None:
            raise LayoutMismatchError(
                f"load_weights would get {name!r}, which the engine does not expect", name
            )
        if want != (shape, dtype):
            raise LayoutMismatchError(
                f"load_weights would get {name!r} as {dtype} {shape}, the engine expects {want[1]} {want[0]}",
                name,
            )
    missing = [name for name in expected if name not in produced]
    if missing:
        raise LayoutMismatchError(
            f"the engine expects {missing[0]!r} ({len(missing)} weight(s) in all), "
            "which no weight of the layout becomes",
            missing[0],
        )


class LoadWeightsConsumer(BufferBase):
    """A `BucketConsumer` that applies each version through ``load_weights`` (see module doc).

    `layout` is the wire's layout (the trainer's names). `transforms` turn those weights into
    what ``load_weights`` takes; `expected` (optional: the engine's ``{name: tensor}`` or
    ``(name, shape, dtype)`` entries, after the transforms) is checked once, here, against what
    the transforms make of the layout. `finalize` runs after ``load_weights`` once per version.
    `on_partial` is told (with the `PartialLoadError`) when the engine was left partly loaded.
    `writes_inputs` (stream mode): ``load_weights`` may write the tensors it is handed, so a
    bucket landed in lent memory is copied first; False hands it over as it lies (read-only
    memory then: an engine that writes it dies with SIGSEGV).
    """

    def __init__(
        self,
        layout: Layout,
        load_weights: LoadWeights,
        *,
        finalize: Callable[[], Any] | None = None,
        transforms: WeightTransform | Sequence[WeightTransform] = (),
        mode: Literal["staged", "stream"] = "staged",
        expected: Expected | None = None,
        on_partial: Callable[[PartialLoadError], Any] | None = None,
        device: str | torch.device = "cpu",
        keep_staging: bool = False,
        writes_inputs: bool = True,
    ) -> None:
        if mode not in ("staged", "stream"):
            raise ValueError(f"LoadWeightsConsumer mode must be 'staged' or 'stream', got {mode!r}")
        if not callable(load_weights):
            raise TypeError(f"load_weights must be callable, got {type(load_weights).__name__}")
        super().__init__(layout)
        self.load_weights = load_weights
        self.finalize = finalize
        self.mode = mode
        self.on_partial = on_partial
        self.device = torch.device(device)
        self.keep_staging = keep_staging
        self.writes_inputs = writes_inputs
        self._chain = transforms if isinstance(transforms, WeightTransform) else TransformChain(transforms)
        entries = ((s.name, s.shape, s.dtype) for s in layout.tensors)
        self.plan: list[Entry] = plan_transforms(self._chain, entries)
        self._planned = {name: (shape, dtype) for name, shape, dtype in self.plan}
        if expected is not None:
            _check_against(self.plan, _expected_entries(expected))
        self.torn = False
        self.last_result: Any = None
        self.copied_bytes = 0  # stream mode: bytes copied out of lent memory before the engine saw them
        self._staging: torch.Tensor | None = None
        self._fed: set[str] = set()
        self._prepared: int | None = None

    @property
    def extra_bytes(self) -> int:
        """Bytes of staging held right now (staged mode, while a version is pending or kept)."""
        return 0 if self._staging is None else self._staging.numel()

    # -- two-phase commit -----------------------------------------------------------------
    def prepare_commit(self, version: int, deadline: Deadline | float | None = None) -> None:
        """Everything `commit` needs short of touching the engine; raises (clearly) if it cannot.

        Staged: every bucket arrived. Stream: the transforms' held-back shards are complete and
        every weight the plan promises was fed exactly once.
        """
        deadline = Deadline.coerce(deadline)
        with self._state_lock:
            if self._pending is None or version != self._pending:
                raise WeightSyncError(
                    f"prepare_commit({version}), but the pending version is {self._pending}"
                )
            missing = [b.index for b in self._layout.buckets if b.index not in self._received]
            if missing:
                raise WeightSyncError(
                    f"version {version} cannot commit: {len(missing)} bucket(s) missing (first {missing[0]})"
                )
            self._prepare(version, deadline)
            self._prepared = version

    def _prepare(self, version: int, deadline: Deadline) -> None:
        if self.mode == "stream":
            self._feed(version, list(self._chain.finish()))
            unfed = [name for name in self._planned if name not in self._fed]
            if unfed:
                raise LayoutMismatchError(
                    f"version {version}: {unfed[0]!r} ({len(unfed)} weight(s) in all) "
                    "never reached load_weights",
                    unfed[0],
                )
        deadline.check(f"preparing version {version} for load_weights")

    # -- BufferBase hooks -----------------------------------------------------------------
    def _begin(self, version: int) -> None:
        if self.torn:
            _log.warning(
                "LoadWeightsConsumer (%s): version %d starts while the engine is partly loaded; "
                "it is repaired only if this version completes",
                self.mode,
                version,
            )
        self._chain.start()
        self._fed = set()
        self._prepared = None
        if self.mode == "staged" and (self._staging is None or not self.keep_staging):
            self._staging = torch.empty(self._layout.padded_bytes, dtype=torch.uint8, device=self.device)

    def bucket_target(self, index: int) -> torch.Tensor | None:
        """Staged mode: where bucket `index` of the pending version may be written directly."""
        with self._state_lock:
            staging = self._staging
            if self._pending is None or staging is None or not 0 <= index < len(self._layout.buckets):
                return None
            start = self._starts[index]
            return staging[start : start + self._layout.buckets[index].nbytes]

    def _stage(self, index: int, data: torch.Tensor) -> None:
        if self.mode == "staged":
            region = self.bucket_target(index)
            assert region is not None
            if not (region.device == data.device and region.data_ptr() == data.data_ptr()):
                region.copy_(data)
            return
        assert self._pending is not None
        views = bucket_views(self._layout, index, self._writable(data))
        weights = [pair for name, view in views.items() for pair in self._chain.feed(name, view)]
        self._feed(self._pending, weights)

    def _writable(self, data: torch.Tensor) -> torch.Tensor:
        """`data`, or a private copy of it when the transport landed it in lent memory (a read-only
        mapping, another process's slot): ``load_weights`` may write what it is handed."""
        if not self.writes_inputs or lent(data) is None:
            return data
        # a fresh buffer per bucket, never a reused one: a loader may keep the tensors it was
        # handed across calls (vLLM's layerwise reload holds a layer's until it is complete)
        self.copied_bytes += data.numel()
        return torch.empty(data.numel(), dtype=torch.uint8, device=data.device).copy_(data)

    def _feed(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Stream mode: check `weights` against the plan, then hand them to the engine."""
        for name, tensor in weights:
            planned = self._planned.get(name)
            if planned is None or name in self._fed:
                why = "twice" if planned is not None else "though the plan does not produce it"
                raise LayoutMismatchError(f"version {version}: {name!r} reached load_weights {why}", name)
            if planned != (tuple(tensor.shape), dtype_name(tensor.dtype)):
                raise LayoutMismatchError(
                    f"version {version}: {name!r} is {dtype_name(tensor.dtype)} {tuple(tensor.shape)}, "
                    f"the plan says {planned[1]} {planned[0]}",
                    name,
                )
        if not weights:
            return
        self._fed.update(name for name, _ in weights)
        self.torn = True  # from here on the engine may hold part of this version
        self._call_engine(version, weights)

    def _call_engine(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        try:
            with torch.no_grad():
                self.last_result = self.load_weights(weights)
        except Exception as exc:
            self.torn = True
            raise PartialLoadError(
                f"load_weights raised while loading version {version} (mode {self.mode!r}): "
                f"{type(exc).__name__}: {exc}; the engine may hold part of it and must be reloaded",
                version=version,
                mode=self.mode,
            ) from exc

    def _staged_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        assert self._staging is not None
        for name, view in flat_views(self._layout, self._staging).items():
            yield from self._chain.feed(name, view)
        yield from self._chain.finish()

    def _publish(self, version: int) -> None:
        if self._prepared != version:
            self._prepare(version, Deadline(None))
        if self.mode == "staged":
            self.torn = True  # load_weights writes the engine in place from its first pair on
            self._call_engine(version, self._staged_weights())
        if self.finalize is not None:
            try:
                self.finalize()
            except Exception as exc:
                raise PartialLoadError(
                    f"finalize raised after load_weights took version {version} (mode {self.mode!r}): "
                    f"{type(exc).__name__}: {exc}; the engine's post-processing is incomplete, reload it",
                    version=version,
                    mode=self.mode,
                ) from exc
        self.torn = False
        self.last_error = None  # the engine holds this whole version: an earlier failure is repaired
        self._prepared = None
        if not self.keep_staging:
            self._staging = None

    def _drop(self) -> None:
        version = self._pending if self._pending is not None else -1
        self._prepared = None
        self._chain.start()  # release shards a fusing stage held back
        if not self.keep_staging:
            self._staging = None
        if not self.torn:
            return  # the engine was not touched: it still holds the applied version
        error = self.last_error
        if not isinstance(error, PartialLoadError):
            cause = error
            error = PartialLoadError(
                f"version {version} failed after load_weights took part of it (mode {self.mode!r}): "
                f"{type(cause).__name__}: {cause}; the engine holds a mix of version {self._version} and "
                f"version {version} and must be reloaded",
                version=version,
                mode=self.mode,
            )
            error.__cause__ = cause
            self.last_error = error
        _log.error("LoadWeightsConsumer: %s", error)
        if self.on_partial is not None:
            try:
                self.on_partial(error)
            except Exception:
                _log.exception("LoadWeightsConsumer: on_partial raised")
