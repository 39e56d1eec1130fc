"""The trainer side of vLLM's "rlfleet" weight-transfer backend (imports vLLM).

``WeightTransferTrainerFactory.trainer_init(VllmTrainerInitInfo(workers=..., rank=r),
client=..., source=ModuleSource(model))`` on every trainer rank. The layout comes from the
source's metadata (names, shapes, dtypes: nothing gathered). Rank 0 makes the transport and
tells the engine about it (``init_weight_transfer_engine``): a node buffer (`SharedBuffer`) the
engine's workers read, or a broadcast group it hosts and every worker joins (its half runs
while the workers join theirs: the first error of either side is raised at once).

`send_weights` is called on every rank (each iterates ``source.iter_full()``: FSDP gathers are
collectives); rank 0 publishes the stream into the node buffer bucket by bucket (or broadcasts
it while the workers receive), then runs ``start_weight_update``, ``update_weights`` and
``finish_weight_update(weight_version=str(version))``, retrying a failed finish (vLLM keeps the
update open until one succeeds).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync.dist._dist import BroadcastSender
from rlfleet.weightsync.dist._member import MemberGroup
from rlfleet.weightsync.dist._rendezvous import host_store
from rlfleet.weightsync.engines._vllm import GROUP_PREFIX
from rlfleet.weightsync.engines._vllm_plugin import VllmTrainerInitInfo, register_vllm_backend, run_together
from rlfleet.weightsync.layout._dtypes import dtype_name
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.shm._shared_buffer import SharedBuffer

__all__ = ["VllmTrainerWeightTransferEngine"]

_log = logging.getLogger(__name__)


def _layout(source: Any, bucket_bytes: int) -> Layout:
    if source is None:
        raise ValueError("rlfleet: trainer_init needs a WeightSource (e.g. ModuleSource(model))")
    if not source.implements_iter_full():
        raise TypeError(
            f"rlfleet sends full tensors, but {type(source).__name__} does not implement iter_full()"
        )
    for meta in source.metadata:
        if meta.owners is not None and meta.owners[0] != 0:
            raise ValueError(
                f"rlfleet: parameter {meta.name!r} is owned from rank {meta.owners[0]}; rank 0 sends every "
                "parameter, so every parameter's owners must start at rank 0"
            )
    return Layout([(m.name, tuple(m.shape), dtype_name(m.dtype)) for m in source.metadata], bucket_bytes)


class VllmTrainerWeightTransferEngine(TrainerWeightTransferEngine[VllmTrainerInitInfo]):
    """rlfleet's trainer side (see the module doc)."""

    init_info_cls = VllmTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, info: VllmTrainerInitInfo, layout: Layout) -> None:
        super().__init__(client=client, source=source, is_sender=info.is_sender, rank=info.rank)
        self.info = info
        self.layout = layout
        self.version = 0
        self.node: SharedBuffer | None = None
        self.sender: BroadcastSender | None = None

    @classmethod
    def trainer_init(
        cls, init_info: VllmTrainerInitInfo, *, client: Any, source: Any = None
    ) -> VllmTrainerWeightTransferEngine:
        engine = cls(
            client=client, source=source, info=init_info, layout=_layout(source, init_info.bucket_bytes)
        )
        if engine.is_sender:
            engine._open()
        return engine

    def _payload(self) -> dict[str, Any]:
        info = self.info
        prefix = None if info.rename_prefix is None else list(info.rename_prefix)
        return {"layout_digest": self.layout.digest, "rename_prefix": prefix, "timeout_s": info.timeout_s}

    def _open(self) -> None:
        info = self.info
        if info.transport == "node":
            self.node = SharedBuffer(self.layout, num_readers=info.workers, checksums=info.checksums)
            payload = dict(self._payload(), transport="node", node_name=self.node.name)
            try:
                self.client.init_weight_transfer_engine(payload)
            except BaseException:
                self.shutdown()
                raise
            return
        store = host_store(info.store_host, info.store_port, timeout_s=info.timeout_s)
        size = 1 + info.workers
        payload = dict(
            self._payload(),
            transport="broadcast",
            store_host=info.store_host,
            store_port=int(store.port),
            group_size=size,
            member_offset=1,
            layout_json=self.layout.to_json().decode(),
            wire=info.wire,
        )
        _, group = run_together(
            [
                lambda: self.client.init_weight_transfer_engine(payload),
                lambda: MemberGroup.create(store, GROUP_PREFIX, 0, size, info.timeout_s, info.wire),
            ],
            info.timeout_s,
            "joining the vLLM workers' broadcast group",
        )
        device = "cuda" if info.wire == "nccl" else "cpu"
        self._store = store  # the workers' store clients need it alive
        self.sender = BroadcastSender(self.layout, group, 0, device=device, checksums=info.checksums)

    def send_weights(self, version: int | None = None) -> None:
        """Send the source's weights as `version` (default: the next one) and apply them in vLLM."""
        assert self.source is not None
        version = self.version + 1 if version is None else version
        if not self.is_sender:
            for _ in self.source.iter_full():
                pass  # the gathers are collectives: every rank iterates
            self.version = version
            return
        deadline = Deadline(self.info.timeout_s)
        update = {"version": version, "timeout_s": self.info.timeout_s}
        if self.node is not None:
            self.node.publish(self.source.iter_full(), version, deadline)
            self.client.start_weight_update()
            self.client.update_weights(update)
        else:
            assert self.sender is not None
            sender = self.sender
            self.client.start_weight_update()
            run_together(
                [
                    lambda: self.client.update_weights(update),
                    lambda: sender.send(self.source.iter_full(), version, deadline),
                ],
                deadline.remaining_or(self.info.timeout_s),
                f"broadcasting version {version}",
            )
        self._finish(version)
        self.version = version

    def _finish(self, version: int) -> None:
        for attempt in range(1 + self.info.finish_retries):
            try:
                self.client.finish_weight_update(weight_version=str(version))
                return
            except Exception as exc:
                if attempt == self.info.finish_retries:
                    raise
                _log.warning("rlfleet: finish of version %d failed (%s); retrying", version, exc)

    def shutdown(self) -> None:
        if self.node is not None:
            self.node.close()
            self.node = None
        self.sender = None


register_vllm_backend()
