"""The engine side of vLLM's "rlfleet" weight-transfer backend (imports vLLM: vLLM processes only).

vLLM's worker calls four phases (`vllm.distributed.weight_transfer.base.WeightTransferEngine`);
here each keeps vLLM's weights untouched until every rank holds a verified version:

- init: attach the transport (the node buffer; or join the trainer's broadcast group) and
  dry-run the model's own ``load_weights`` on the trainer's layout (`record_loader_map`): a
  layout the loader cannot fully load (a parameter nothing writes) fails here, and the map
  gives the transforms (drop what the loader ignores, such as a tied ``lm_head.weight``; cast
  to the dtype each tensor lands in). A loader no copy map describes (one that computes what it
  writes) is applied without them, with a warning.
- start: nothing (the model keeps serving).
- update: node buffer: wait for the version and verify it (CRC32s, under a pin), no copy (at
  finish the tensors stream from the pinned slot into vLLM's reload, each copied once on its way);
  broadcast: receive it into a staging copy under the transport's two-phase commit. Then
  every rank votes over vLLM's world CPU group: all staged it, or every rank raises, naming the
  failed ranks, and nothing is applied. Calling it again for the same version (chunks) is a no-op.
- finish: every rank checks it prepared the same version (a second vote), then applies it with
  vLLM's layerwise reload (`reload_vllm_weights`; its post-processing included, so
  ``process_weights_after_loading`` is not called again). Only ``load_weights`` itself can fail
  once the model is touched: the error (`PartialLoadError`) names it, vLLM keeps the update
  open, and the retried finish applies the same version again (from the node buffer, or from
  the kept staging copy).

Registered with vLLM's factory when imported (`register_vllm_backend`, also the plugin entry point).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import LayoutMismatchError, SyncTimeoutError, VersionError, WeightSyncError
from rlfleet.weightsync.buffers._consumers import DeferredCommit
from rlfleet.weightsync.dist._dist import BroadcastReceiver
from rlfleet.weightsync.dist._member import MemberGroup
from rlfleet.weightsync.dist._rendezvous import connect_store
from rlfleet.weightsync.engines._load_weights import LoadWeightsConsumer
from rlfleet.weightsync.engines._loader_map import LoaderMap, UnmappableLoaderError
from rlfleet.weightsync.engines._loader_record import record_loader_map
from rlfleet.weightsync.engines._transforms import Rename, WeightTransform, plan_transforms
from rlfleet.weightsync.engines._vllm_plugin import (
    VllmInitInfo,
    VllmUpdateInfo,
    register_vllm_backend,
    reload_vllm_weights,
)
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.layout._lent import lent
from rlfleet.weightsync.shm._shared_reader import SharedBufferReader

__all__ = ["VllmWeightTransferEngine"]

_log = logging.getLogger(__name__)
GROUP_PREFIX = "rlfleet/vllm"


def _world() -> Any:
    from vllm.distributed import get_world_group

    return get_world_group()


def vote(value: int, deadline: Deadline, what: str) -> list[int]:
    """Every rank's `value` (>= 0), gathered over vLLM's world CPU group within the deadline."""
    group = _world()
    if group.world_size == 1:
        return [value]
    values = torch.zeros(group.world_size, dtype=torch.int64)
    values[group.rank_in_group] = value
    work = torch.distributed.all_reduce(values, group=group.cpu_group, async_op=True)
    seconds = max(deadline.remaining_or(60.0), 1.0)
    try:
        work.wait(timeout=timedelta(seconds=seconds))
    except RuntimeError as exc:
        raise SyncTimeoutError(f"rlfleet: the vote on {what} across vLLM ranks timed out ({exc})") from exc
    return [int(v) for v in values.tolist()]


class VllmWeightTransferEngine(WeightTransferEngine[VllmInitInfo, VllmUpdateInfo]):
    """rlfleet's versioned, verified, all-ranks-or-none weight transfer (see the module doc)."""

    init_info_cls = VllmInitInfo
    update_info_cls = VllmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.info: VllmInitInfo | None = None
        self.layout: Layout | None = None
        self.loader_map: LoaderMap | None = None
        self.applied = -1
        self._reader: SharedBufferReader | None = None
        self._receiver: BroadcastReceiver | None = None
        self._group: MemberGroup | None = None
        self._staged: LoadWeightsConsumer | None = None  # broadcast: the staging consumer
        self._deferred: DeferredCommit | None = None
        self._transforms: list[WeightTransform] = []
        self._ready: int | None = None  # verified (node) or staged (broadcast) on every rank
        self._retry: int | None = None  # a version whose finish failed: the next finish applies it

    @property
    def rank(self) -> int:
        return int(_world().rank_in_group)

    # -- init ---------------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: VllmInitInfo) -> None:
        """Attach the transport and check the layout against the model's own loader."""
        self.shutdown()
        self.applied = -1  # a new transport, a new trainer: its versions start afresh
        deadline = Deadline(init_info.timeout_s)
        if init_info.transport == "node":
            self._reader = SharedBufferReader.attach(init_info.node_name, timeout_s=init_info.timeout_s)
            layout = self._reader.layout
        else:
            layout = Layout.from_json(init_info.layout_json)
        if layout.digest != init_info.layout_digest:
            self.shutdown()
            raise LayoutMismatchError(
                f"rlfleet: the trainer announced layout {init_info.layout_digest[:12]}, "
                f"the {init_info.transport} transport holds {layout.digest[:12]}"
            )
        try:
            self._plan(layout, init_info)
            if init_info.transport == "broadcast":
                self._join(layout, init_info, deadline)
        except BaseException:
            self.shutdown()
            raise
        self.info, self.layout = init_info, layout

    def _plan(self, layout: Layout, info: VllmInitInfo) -> None:
        """Dry-run ``load_weights`` on the layout (renamed): the map, its checks and transforms."""
        from vllm.config import set_current_vllm_config

        prefix = info.prefix
        rename: list[WeightTransform] = [] if prefix is None else [Rename.prefix(*prefix)]
        entries = plan_transforms(rename, ((s.name, s.shape, s.dtype) for s in layout.tensors))
        loader: Any = self.model
        try:
            with set_current_vllm_config(self.vllm_config):
                loader_map = record_loader_map(loader.load_weights, self.model, entries)
        except UnmappableLoaderError as exc:  # e.g. a loader that quantizes as it loads
            _log.warning("rlfleet: no loader map for this model (%s): the layout is not checked at init", exc)
            self.loader_map, self._transforms = None, rename
            return
        loader_map.require_covered()
        ignored = loader_map.unused()
        if ignored:
            _log.info("rlfleet: vLLM's load_weights ignores %d trainer tensor(s): %s", len(ignored), ignored)
        self.loader_map = loader_map
        self._transforms = rename + loader_map.transforms()

    def _join(self, layout: Layout, info: VllmInitInfo, deadline: Deadline) -> None:
        member = info.member_offset + self.rank
        store = connect_store(info.store_host, info.store_port, member, info.group_size, deadline)
        self._group = MemberGroup.create(
            store, GROUP_PREFIX, member, info.group_size, info.timeout_s, info.wire
        )
        device = self.device if info.wire == "nccl" else torch.device("cpu")
        self._receiver = BroadcastReceiver(layout, self._group, 0, device=device)
        self._staged = LoadWeightsConsumer(
            layout, self._reload, transforms=self._transforms, mode="staged", keep_staging=True
        )
        self._deferred = DeferredCommit(self._staged)

    def _reload(self, weights: Any) -> Any:
        return reload_vllm_weights(self.model, self.model_config, weights, self.device)

    # -- start / update -------------------------------------------------------------------------
    def start_weight_update(self) -> None:
        """Nothing to do: the model keeps serving its version until finish."""

    def receive_weights(self, update_info: VllmUpdateInfo) -> None:
        """Verify (node) or stage (broadcast) the version, then the all-ranks vote."""
        info = self._require_init()
        version = update_info.version
        deadline = Deadline(update_info.timeout_s if update_info.timeout_s is not None else info.timeout_s)
        if self._ready == version:
            return  # a later chunk of a version already here
        self._ready = None
        error: BaseException | None = None
        try:
            if version <= self.applied:
                raise VersionError(f"rlfleet: version {version} is not newer than the applied {self.applied}")
            if self._reader is not None:
                self._reader.check_version(version, deadline)
            else:
                receiver, deferred = self._receiver, self._deferred
                assert receiver is not None
                assert deferred is not None
                receiver.receive(deferred, deadline)
                if deferred.staged != version:
                    raise VersionError(
                        f"rlfleet: asked for version {version}, the trainer sent {deferred.staged}"
                    )
        except BaseException as exc:  # vote first, raise after: no rank may wait in the vote for us
            error = exc
        votes = vote(0 if error is not None else 1, deadline, f"version {version}")
        if error is not None:
            raise error
        failed = [rank for rank, ok in enumerate(votes) if not ok]
        if failed:
            raise WeightSyncError(
                f"rlfleet: version {version} failed on vLLM rank(s) {failed}; "
                f"nothing applied on rank {self.rank}"
            )
        self._ready, self._retry = version, None

    # -- finish -----------------------------------------------------------------------------------
    def finish_weight_update(self) -> None:
        """Every rank prepared the same version, then vLLM's reload applies it (see the module doc)."""
        info = self._require_init()
        version = self._ready if self._ready is not None else self._retry
        deadline = Deadline(info.timeout_s)
        votes = vote(version + 1 if version is not None else 0, deadline, "the version to apply")
        if len(set(votes)) != 1:
            raise WeightSyncError(
                f"rlfleet: vLLM ranks hold different versions to apply ({[v - 1 for v in votes]}; -1: none); "
                "nothing applied"
            )
        if version is None:
            return  # nothing arrived since the last applied version: vLLM's weights are unchanged
        self._ready, self._retry = None, version
        if self._reader is not None:
            self._apply_from_node(version, deadline)
        else:
            self._apply_staged(version, deadline)
        self._retry, self.applied = None, version

    def _apply_from_node(self, version: int, deadline: Deadline) -> None:
        """Stream the verified version from the node buffer's pinned slot into vLLM's reload."""
        reader = self._reader
        assert reader is not None
        started = False

        def load(weights: Any) -> Any:
            nonlocal started
            if not started:  # the model is touched only once the slot is pinned and the first bucket read
                from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

                initialize_layerwise_reload(self.model)
                started = True
            # vLLM's layerwise reload keeps what it is handed until a layer is complete, across
            # calls: a tensor still in the node buffer's read-only mapping gets a copy of its own
            # (never a reused bucket buffer, which the next bucket would overwrite)
            owned = [(name, t.clone() if lent(t) is not None else t) for name, t in weights]
            loader: Any = self.model
            return loader.load_weights(owned)

        consumer = LoadWeightsConsumer(
            reader.layout, load, transforms=self._transforms, mode="stream", writes_inputs=False
        )
        try:
            reader.copy_version(version, consumer, deadline)
        finally:
            if started:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

                finalize_layerwise_reload(self.model, self.model_config)

    def _apply_staged(self, version: int, deadline: Deadline) -> None:
        """Commit the staged version (vLLM's reload); after a failed commit, re-stage it in place."""
        staged = self._staged
        assert staged is not None
        if staged.pending_version != version:  # a retry: the staging copy still holds the version
            staged.begin(version)
            for index in range(len(staged.layout.buckets)):
                target = staged.bucket_target(index)
                assert target is not None
                staged.consume(index, target)  # the same bytes: no copy
        staged.prepare_commit(version, deadline)
        staged.commit(version)

    def _require_init(self) -> VllmInitInfo:
        if self.info is None:
            raise WeightSyncError("rlfleet: init_weight_transfer_engine was not called (or failed)")
        return self.info

    def shutdown(self) -> None:
        """Leave the node buffer or the group; the model keeps its weights."""
        if self._reader is not None:
            self._reader.close()
        self._reader = self._receiver = self._group = None
        self._staged = self._deferred = None
        self.info = None
        self._ready = self._retry = None


register_vllm_backend()
