"""A worker's weights as syncs move them: what one process keeps from one sync to the next.

Each optional: the node buffer it writes (a `SharedBuffer`: a trainer on the node publishes each
version into it once, or the one rollout worker that receives for the node lands a broadcast in
it), the layout it sends with, the endpoint it receives through (`create_endpoint`: one
strategy at a time), and the CUDA IPC channels it writes or reads (`_ipc_worker`). Its
`version` is the endpoint's when there is one, so a worker reports one version whatever its role.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import LayoutMismatchError, WeightSyncError
from rlfleet.weightsync.buffers._buffers import ServingLock
from rlfleet.weightsync.endpoints._endpoints import DEFAULT_TIMEOUT_S, WeightEndpoint, create_endpoint
from rlfleet.weightsync.endpoints._ipc_worker import IpcChannelReader, IpcChannelWriter, cuda_device_of
from rlfleet.weightsync.endpoints._strategy import check_strategy
from rlfleet.weightsync.layout._layout import DEFAULT_BUCKET_BYTES, Layout, WireDtype
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.shm._shared_buffer import SharedBuffer
from rlfleet.weightsync.shm._shm import cleanup_stale_segments

__all__ = ["WorkerWeights"]


class WorkerWeights:
    """Node buffer writer, send layout and receive endpoint of one worker.

    `serving_lock`: the worker's (its endpoint applies under it); `who`: names the worker in
    errors; `bucket_bytes`: the layout's bucket size when no sender's layout is given;
    `commit_timeout_s`: an apply's drain; `attach_timeout_s`: joining a node buffer;
    `write_timeout_s`: a node buffer writer's wait for its readers.
    """

    def __init__(
        self,
        serving_lock: ServingLock,
        who: Callable[[], str] = lambda: "worker",
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        commit_timeout_s: float = DEFAULT_TIMEOUT_S,
        attach_timeout_s: float = DEFAULT_TIMEOUT_S,
        write_timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.serving_lock, self.who, self.bucket_bytes = serving_lock, who, bucket_bytes
        self.write_timeout_s = write_timeout_s
        self._timeouts = {"commit_timeout_s": commit_timeout_s, "attach_timeout_s": attach_timeout_s}
        self.endpoint: WeightEndpoint | None = None
        self.node_writer: SharedBuffer | None = None
        self.sender_layout: Layout | None = None
        self._wire: WireDtype = None  # the wire dtype `sender_layout` casts to
        self.send_lock = threading.Lock()  # concurrent sends of one version lay out and pack once
        self._version = 0
        self._shm_prefix: str | None = None  # name prefix of the group's node buffers (cleanup)
        self.ipc_writer = IpcChannelWriter()
        self.ipc_reader = IpcChannelReader()

    @property
    def version(self) -> int:
        """The version the worker computes with (its endpoint's, when it has one)."""
        return self.endpoint.version if self.endpoint is not None else self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = int(value)
        if self.endpoint is not None:
            self.endpoint.version = self._version

    # -- receiving ----------------------------------------------------------------------
    def require_endpoint(self) -> WeightEndpoint:
        if self.endpoint is None:
            raise WeightSyncError(f"{self.who()}: init_weight_buffer() has not been called")
        return self.endpoint

    def init_endpoint(
        self,
        module: torch.nn.Module,
        strategy: str,
        node: Mapping[str, Any] | None,
        sender: Mapping[str, Any] | None,
    ) -> WeightEndpoint:
        """Receive with `strategy` from now on. `node`: the node buffer's "name" (and "rank",
        "world_size" for "Sharded"); `sender`: the trainers' layout, which ours must equal."""
        check_strategy(strategy)
        bucket_bytes = self.bucket_bytes if sender is None else int(sender["bucket_bytes"])
        mine = Layout.from_state_dict(module.state_dict(), bucket_bytes)
        if sender is not None:
            try:
                mine.require_same(Layout.from_dict(sender))
            except LayoutMismatchError as exc:
                message = f"{self.who()}: model does not match the trainer's: {exc}"
                raise LayoutMismatchError(message, exc.parameter) from None
        self.release_endpoint()
        name = None if node is None or node.get("name") is None else str(node["name"])
        if name is not None:
            self._shm_prefix = name.split("_", 1)[0]
        shard = None if node is None or "rank" not in node else (int(node["rank"]), int(node["world_size"]))
        self.endpoint = create_endpoint(
            strategy,
            module,
            mine,
            node_buffer=name,
            node_writer=self.node_writer if strategy == "Shared" else None,
            shard=shard,
            version=self._version,
            serving_lock=self.serving_lock,
            **self._timeouts,
        )
        return self.endpoint

    def consumers(self) -> list[BucketConsumer]:
        """Every buffer received bytes land in here (the endpoint's, the node buffer written)."""
        found = [None if self.endpoint is None else self.endpoint.consumer, self.node_writer]
        return [c for c in found if c is not None]

    def release_endpoint(self) -> None:
        """Give the module private, writable storage again (role change, buffer rebuild)."""
        endpoint, self.endpoint = self.endpoint, None
        if endpoint is not None:
            self._version = endpoint.version
            endpoint.release()

    def release(self) -> int:
        """Leave every node buffer, unlinking the one this worker wrote, and every IPC channel;
        how many node buffers were unlinked."""
        self.ipc_reader.close()
        self.ipc_writer.close()
        self.release_endpoint()
        writer, self.node_writer = self.node_writer, None
        removed = 0
        if writer is not None:
            writer.close()  # unlinks; bound readers keep their views until they rebind
            removed = 1
        if self._shm_prefix is not None:  # a writer of our group SIGKILLed on this node left its buffer
            removed += len(cleanup_stale_segments(self._shm_prefix))
        self.sender_layout = None
        return removed

    # -- sending ------------------------------------------------------------------------
    def layout_for(self, module: torch.nn.Module, bucket_bytes: int, wire_dtype: WireDtype = None) -> Layout:
        """The layout this worker sends with (computed once per bucket size and wire dtype)."""
        with self.send_lock:
            layout = self.sender_layout
            if layout is None or layout.bucket_bytes != bucket_bytes or self._wire != wire_dtype:
                layout = Layout.from_state_dict(module.state_dict(), bucket_bytes, wire_dtype=wire_dtype)
                self.sender_layout, self._wire = layout, wire_dtype
            return layout

    def create_writer(self, layout: Mapping[str, Any], num_readers: int, prefix: str, checksums: bool) -> str:
        """Become the writer of this node's buffer (two slots); its name, for the readers.

        The buffer's layout is the group's (the trainers'); a later publish of a model that no
        longer fits it fails on this side, naming the parameter, before any reader takes bytes.
        """
        if self.node_writer is not None:
            self.node_writer.close()
        self._shm_prefix = prefix
        cleanup_stale_segments(prefix)  # the buffer of a writer of this group that was killed here
        self.node_writer = SharedBuffer(
            Layout.from_dict(layout),
            num_readers,
            timeout_s=self.write_timeout_s,
            prefix=prefix,
            checksums=checksums,
        )
        return self.node_writer.name

    def publish(self, module: torch.nn.Module, version: int, timeout_s: float) -> int:
        """Write `version` of the module once into the node buffer (a retried sync finds it there)."""
        with self.send_lock:
            if self.node_writer is None:
                raise WeightSyncError(f"{self.who()}: not the writer of a node buffer")
            if self.node_writer.version < version:
                self.node_writer.publish(module.state_dict(), version, Deadline(timeout_s))
        return version

    # -- CUDA IPC -----------------------------------------------------------------------
    def ipc_channel(
        self,
        module: torch.nn.Module,
        readers: Sequence[str],
        backend: str,
        bucket_bytes: int | None = None,
        checksums: bool = False,
        delta: str = "off",
        wire_dtype: WireDtype = None,
    ) -> str:
        """The name of the IPC channel this worker writes to `readers` (made at first use, kept
        while they stay the same); its layout is this worker's send layout (`bucket_bytes`:
        the group's bucket size; default this worker's; `wire_dtype`: what floating weights
        travel as, cast while packing); `delta`: the channel's delta mode."""
        size = self.bucket_bytes if bucket_bytes is None else bucket_bytes
        layout = self.layout_for(module, size, wire_dtype)
        device = cuda_device_of(module) if backend == "cuda" else None
        return self.ipc_writer.channel(readers, layout, backend, device, checksums, delta)

    def ipc_send(self, module: torch.nn.Module, name: str, version: int, deadline: Deadline) -> int:
        """Send `version` of the module through IPC channel `name`; returns once every reader
        committed it (or raises, and no reader applied it)."""
        return self.ipc_writer.send(name, module.state_dict(), version, deadline)

    def ipc_receive(
        self, module: torch.nn.Module, name: str, index: int, version: int, deadline: Deadline
    ) -> int:
        """Take `version` from IPC channel `name` as its reader `index` into this worker's endpoint."""
        endpoint = self.require_endpoint()
        return self.ipc_reader.receive(endpoint, name, index, version, deadline, cuda_device_of(module))
