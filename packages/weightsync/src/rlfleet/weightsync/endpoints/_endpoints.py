"""Receive strategies ("endpoints"): how a rollout worker takes a version and makes it live.

One endpoint type per strategy, all behind `WeightEndpoint`; each wraps one module:

- `DirectEndpoint` ("None"): the version lands in a transient copy applied at once (the
  receiver is drained for the transfer: serving waits for the whole receive).
- `DoubleEndpoint` ("Double"): the version lands in a private staging copy while the module
  serves the previous one; `apply` swaps storages (no copy).
- `SharedEndpoint` ("Shared"): the module computes with zero-copy views of its node's
  `SharedBuffer`; `apply` rebinds them to the new slot. The node's writer (a trainer on the
  node, or the one endpoint that receives for the node) fills it.
- `ShardedEndpoint` ("Sharded"): keeps 1/N of each version; `apply` all-gathers the node's
  shares over a group and points the module at the gathered block.

A version comes from a node's shared buffer (`stage_from_node`: a trainer on this node wrote
it once) or from a transport (`receive`: anything with ``receive(consumer, deadline)``, e.g.
`BroadcastReceiver`, `ShmRingReceiver`). It is staged first and made live by `apply`, under the
endpoint's `ServingLock`, so a request sees all of one version. A failed receive or apply keeps
the applied version; `release` gives the module private, writable storage again.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Protocol

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import VersionError, WeightSyncError
from rlfleet.weightsync.buffers._buffers import DirectBuffer, DoubleBuffer, ServingLock
from rlfleet.weightsync.buffers._consumers import DeferredCommit, DiscardingConsumer, ExpectedVersion
from rlfleet.weightsync.buffers._sharded import ShardedBuffer
from rlfleet.weightsync.endpoints._strategy import WeightBufferStrategy, check_strategy
from rlfleet.weightsync.layout._block import adopt, live_tensors
from rlfleet.weightsync.layout._layout import Layout
from rlfleet.weightsync.protocol._protocol import BucketConsumer
from rlfleet.weightsync.shm._shared_buffer import SharedBuffer, SharedBufferReader

__all__ = [
    "DirectEndpoint",
    "DoubleEndpoint",
    "ShardedEndpoint",
    "SharedEndpoint",
    "TransportReceiver",
    "WeightEndpoint",
    "commit_consumer",
    "create_endpoint",
]

DEFAULT_TIMEOUT_S = 60.0


class TransportReceiver(Protocol):
    """The receiving end of a transport: one version into `consumer` per call."""

    def receive(self, consumer: BucketConsumer, deadline: Deadline | float | None = None) -> Any: ...


class WeightEndpoint(Protocol):
    """What every receive strategy offers its worker."""

    strategy: ClassVar[WeightBufferStrategy]
    layout: Layout
    serving_lock: ServingLock

    @property
    def version(self) -> int: ...
    @version.setter
    def version(self, value: int) -> None: ...
    @property
    def staged_version(self) -> int | None: ...
    @property
    def consumer(self) -> BucketConsumer | None: ...
    def has(self, version: int) -> bool: ...
    def stage_from_node(self, name: str, version: int, deadline: Deadline | float | None = None) -> int: ...
    def receive(
        self, transport: TransportReceiver, version: int, deadline: Deadline | float | None = None
    ) -> int: ...
    def apply(
        self, version: int | None = None, deadline: Deadline | float | None = None, group: Any = None
    ) -> int: ...
    def wait_applied(self, timeout: float) -> bool: ...
    def release(self) -> None: ...


def commit_consumer(consumer: BucketConsumer, version: int, deadline: Deadline) -> None:
    """``prepare_commit`` (when the consumer has it) then ``commit``; a refused prepare aborts."""
    prepare = getattr(consumer, "prepare_commit", None)
    if prepare is not None:
        try:
            prepare(version, deadline)
        except BaseException as exc:
            consumer.abort(exc)
            raise
    consumer.commit(version)


def _version_of(result: Any) -> int:
    """Transports return the version (an int) or stats carrying it."""
    return int(result if isinstance(result, int) else result.version)


class _Endpoint:
    """Versions, the staged version, the node buffer reader and the apply protocol."""

    strategy: ClassVar[WeightBufferStrategy]

    def __init__(
        self,
        module: torch.nn.Module,
        layout: Layout,
        *,
        version: int = 0,
        node_buffer: str | None = None,
        serving_lock: ServingLock | None = None,
        commit_timeout_s: float | None = DEFAULT_TIMEOUT_S,
        attach_timeout_s: float | None = DEFAULT_TIMEOUT_S,
    ) -> None:
        layout.check_state_dict(live_tensors(module))
        self.module = module
        self.layout = layout
        self.serving_lock = serving_lock if serving_lock is not None else ServingLock()
        self.commit_timeout_s = commit_timeout_s
        self._version = int(version)
        self._staged: int | None = None
        self._applied = threading.Event()
        self._applied.set()
        self._node: SharedBufferReader | None = None
        if node_buffer is not None:
            self._node = SharedBufferReader.attach(
                node_buffer, expected_layout=layout, timeout_s=attach_timeout_s
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(version={self._version}, staged={self._staged})"

    @property
    def version(self) -> int:
        """The applied version (what the module computes with)."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """Set when the module's weights were replaced another way (a checkpoint, a state dict)."""
        self._version = int(value)

    @property
    def staged_version(self) -> int | None:
        """The version received and waiting for `apply`, if any."""
        return self._staged

    @property
    def consumer(self) -> BucketConsumer | None:
        """The buffer a transport lands this endpoint's versions in (None: it receives none)."""
        return None

    def has(self, version: int) -> bool:
        """True when `version` needs nothing more here (a retried sync resends it)."""
        return version <= self._version

    def wait_applied(self, timeout: float) -> bool:
        """True once no received version waits to be applied (False on timeout)."""
        return self._applied.wait(timeout) and self._staged is None

    def _reader(self, name: str) -> SharedBufferReader:
        if self._node is None or self._node.name != name:
            raise WeightSyncError(f"{self!r} is not a reader of node buffer {name!r}")
        return self._node

    # -- taking a version -----------------------------------------------------------------
    def stage_from_node(self, name: str, version: int, deadline: Deadline | float | None = None) -> int:
        """Take `version` from this node's shared buffer `name` (written once by its writer); the
        version staged, newer when the writer already replaced `version` (see `_newest_instead`)."""
        self._applied.clear()
        reader = self._reader(name)
        if self.has(version):
            self._applied.set()
            return version
        deadline = Deadline.coerce(deadline)
        try:
            self._stage_from(reader, version, deadline)
        except VersionError as exc:
            newest = self._newest_instead(reader, version, exc)
            self._stage_from(reader, newest, deadline)
            return newest
        return version

    @staticmethod
    def _newest_instead(reader: SharedBufferReader, version: int, error: VersionError) -> int:
        """Async RL: the trainer committed newer versions while this worker was still to take
        `version`, which is gone: take the newest (skip ahead; no queue of stale versions)."""
        newest = reader.latest_version()
        if newest <= version:
            raise error
        return newest

    def receive(
        self, transport: TransportReceiver, version: int, deadline: Deadline | float | None = None
    ) -> int:
        """Take `version` from a transport; a version already held is received and dropped (the
        collective needs every member), anything else is staged (or, "None", applied). A sender
        announcing another version is refused before any byte lands (`VersionError`)."""
        self._applied.clear()
        deadline = Deadline.coerce(deadline)
        if self.has(version):
            transport.receive(self._only(DiscardingConsumer(self.layout, version), version), deadline)
            self._held(version)
            self._applied.set()
            return version
        got = _version_of(self._receive(transport, version, deadline))
        if got != version:
            raise VersionError(f"{self!r}: expected v{version}, got v{got}")
        return got

    def apply(
        self, version: int | None = None, deadline: Deadline | float | None = None, group: Any = None
    ) -> int:
        """Make the staged version live (`group`: the node's gather group, "Sharded" only)."""
        staged = self._staged
        if staged is None:
            self._applied.set()
            return self._version
        if version is not None and staged < version:  # a newer one staged: it skipped ahead
            raise VersionError(f"{self!r}: asked to apply v{version}, staged is v{staged}")
        deadline = Deadline.coerce(deadline if deadline is not None else self.commit_timeout_s)
        try:
            with self.serving_lock.exclusive(deadline):
                live = self._make_live(staged, deadline, group)  # "Shared" may bind a newer one
                self._version, self._staged = staged if live is None else max(staged, live), None
        finally:
            self._applied.set()  # wakes waiters on success and on failure
        return self._version

    def release(self) -> None:
        """Give the module private, writable storage and leave the node buffer."""
        self._release()
        node, self._node = self._node, None
        if node is not None:
            node.close()

    def _only(self, consumer: BucketConsumer, version: int) -> BucketConsumer:
        """`consumer`, refusing any version but `version` at its begin (before a byte lands)."""
        return ExpectedVersion(consumer, version, repr(self))

    # -- strategy hooks -------------------------------------------------------------------
    def _held(self, version: int) -> None:
        pass

    def _stage_from(self, reader: SharedBufferReader, version: int, deadline: Deadline) -> None:
        raise NotImplementedError

    def _receive(self, transport: TransportReceiver, version: int, deadline: Deadline) -> Any:
        raise NotImplementedError

    def _make_live(self, version: int, deadline: Deadline, group: Any) -> int | None:
        """Make `version` live; the version bound when it is newer (None: `version`)."""
        raise NotImplementedError

    def _release(self) -> None:
        pass


class _BufferedEndpoint(_Endpoint):
    """An endpoint over a private weightsync buffer (`DirectBuffer` / `DoubleBuffer`)."""

    _buffer: DirectBuffer | DoubleBuffer

    @property
    def consumer(self) -> BucketConsumer | None:
        return self._buffer

    def _stage_from(self, reader: SharedBufferReader, version: int, deadline: Deadline) -> None:
        reader.copy_version(version, DeferredCommit(self._buffer), deadline)
        self._staged = version

    def _make_live(self, version: int, deadline: Deadline, group: Any) -> int | None:
        commit_consumer(self._buffer, version, deadline)
        return None

    def _release(self) -> None:
        self._buffer.abort(WeightSyncError("weight buffer released"))


class DirectEndpoint(_BufferedEndpoint):
    """Strategy "None": each version is applied as soon as it arrived (`DirectBuffer`)."""

    strategy: ClassVar[WeightBufferStrategy] = "None"

    def __init__(self, module: torch.nn.Module, layout: Layout, **options: Any) -> None:
        super().__init__(module, layout, **options)
        self._buffer = DirectBuffer(live_tensors(module), layout, commit_timeout_s=self.commit_timeout_s)

    def _stage_from(self, reader: SharedBufferReader, version: int, deadline: Deadline) -> None:
        super()._stage_from(reader, version, deadline)
        self.apply(version)

    def _receive(self, transport: TransportReceiver, version: int, deadline: Deadline) -> Any:
        with self.serving_lock.exclusive(deadline):  # in place: the worker was drained first
            result = transport.receive(self._only(self._buffer, version), deadline)
            self._version, self._staged = _version_of(result), None
            self._applied.set()
        return result


class DoubleEndpoint(_BufferedEndpoint):
    """Strategy "Double": stage a private copy while serving, swap storages at `apply`."""

    strategy: ClassVar[WeightBufferStrategy] = "Double"

    def __init__(self, module: torch.nn.Module, layout: Layout, **options: Any) -> None:
        super().__init__(module, layout, **options)
        live = live_tensors(module)
        self._buffer = DoubleBuffer(live, layout, mode="swap", commit_timeout_s=self.commit_timeout_s)

    def _receive(self, transport: TransportReceiver, version: int, deadline: Deadline) -> Any:
        result = transport.receive(self._only(DeferredCommit(self._buffer), version), deadline)
        self._staged = _version_of(result)
        return result


class SharedEndpoint(_Endpoint):
    """Strategy "Shared": the module reads its node's shared buffer zero-copy.

    `node_buffer` names the node's `SharedBuffer`; `node_writer` is that buffer itself when
    this process fills it for the node (it then receives from a transport into it).
    """

    strategy: ClassVar[WeightBufferStrategy] = "Shared"

    def __init__(
        self,
        module: torch.nn.Module,
        layout: Layout,
        *,
        node_buffer: str,
        node_writer: SharedBuffer | None = None,
        **options: Any,
    ) -> None:
        super().__init__(module, layout, node_buffer=node_buffer, **options)
        assert self._node is not None
        self._node.bind_module(module)  # takes effect at the first refresh (the first apply)
        self._writer = node_writer

    def data_range(self) -> tuple[int, int]:
        """[start, end) addresses of this process's mapping of the node buffer (zero-copy check)."""
        if self._node is None:
            raise WeightSyncError(f"{self!r} was released")
        return self._node.data_range()

    @property
    def consumer(self) -> BucketConsumer | None:
        return self._writer

    def has(self, version: int) -> bool:
        writer = self._writer
        return super().has(version) or (writer is not None and writer.version >= version)

    def stage_from_node(self, name: str, version: int, deadline: Deadline | float | None = None) -> int:
        """Nothing to copy: wait until the node's writer committed `version` (and verify it)."""
        self._applied.clear()
        reader, deadline = self._reader(name), Deadline.coerce(deadline)
        try:
            reader.check_version(version, deadline)
        except VersionError as exc:
            version = self._newest_instead(reader, version, exc)
            reader.check_version(version, deadline)
        self._staged = version
        return version

    def _held(self, version: int) -> None:
        if version > self._version:  # in the node buffer already, not yet bound here
            self._staged = version

    def _receive(self, transport: TransportReceiver, version: int, deadline: Deadline) -> Any:
        if self._writer is None:
            raise WeightSyncError(f"{self!r} does not write its node's buffer: it reads it (stage_from_node)")
        result = transport.receive(self._only(self._writer, version), deadline)
        self._staged = _version_of(result)
        return result

    def _make_live(self, version: int, deadline: Deadline, group: Any) -> int | None:
        """Bind the newest committed slot: a version the writer committed since `version` was
        staged is taken at once (the worker skips ahead; no queue of stale versions)."""
        assert self._node is not None
        return self._node.refresh(deadline)

    def _release(self) -> None:
        if self._node is not None:
            adopt(self.module, self.layout)  # copy out of the read-only mapping before leaving it


class ShardedEndpoint(_Endpoint):
    """Strategy "Sharded": keep share `rank` of `world_size` of each version (`ShardedBuffer`);
    `apply` all-gathers the shares over the node's group, the same call on every member."""

    strategy: ClassVar[WeightBufferStrategy] = "Sharded"

    def __init__(
        self, module: torch.nn.Module, layout: Layout, *, shard: tuple[int, int], **options: Any
    ) -> None:
        super().__init__(module, layout, **options)
        rank, world_size = shard
        self._shares = ShardedBuffer(layout, int(rank), int(world_size))
        self._gathered: torch.Tensor | None = None  # the block the module computes with

    @property
    def consumer(self) -> BucketConsumer | None:
        return self._shares

    def _stage_from(self, reader: SharedBufferReader, version: int, deadline: Deadline) -> None:
        if self._shares.version < version:  # committed at once: the module still serves its copy
            reader.copy_version(version, self._shares, deadline)
        self._staged = version

    def _receive(self, transport: TransportReceiver, version: int, deadline: Deadline) -> Any:
        result = transport.receive(self._only(self._shares, version), deadline)  # this member's buckets
        self._staged = _version_of(result)
        return result

    def _make_live(self, version: int, deadline: Deadline, group: Any) -> int | None:
        if group is None:
            raise ValueError("a Sharded apply needs the group of the node's endpoints (group=...)")
        shares = self._shares
        block = torch.empty(shares.shard_bytes * shares.world_size, dtype=torch.uint8)
        views = shares.gather(group, deadline, out=block)  # a fresh block: the old one still serves
        live = live_tensors(self.module)
        with torch.no_grad():
            for name, view in views.items():
                live[name].data = view
        self._gathered = block
        return None

    def _release(self) -> None:
        if self._gathered is not None:
            adopt(self.module, self.layout)
            self._gathered = None


_ENDPOINTS: dict[str, type[_Endpoint]] = {
    cls.strategy: cls for cls in (DirectEndpoint, DoubleEndpoint, SharedEndpoint, ShardedEndpoint)
}


def create_endpoint(
    strategy: str,
    module: torch.nn.Module,
    layout: Layout,
    *,
    node_buffer: str | None = None,
    node_writer: SharedBuffer | None = None,
    shard: tuple[int, int] | None = None,
    **options: Any,
) -> WeightEndpoint:
    """The endpoint of `strategy` over `module`; `options`: version, serving_lock,
    commit_timeout_s, attach_timeout_s. "Shared" needs `node_buffer`, "Sharded" `shard`."""
    cls = _ENDPOINTS[check_strategy(strategy)]
    if cls is SharedEndpoint:
        if node_buffer is None:
            raise ValueError("strategy 'Shared' needs the name of its node's buffer (node_buffer=...)")
        return SharedEndpoint(module, layout, node_buffer=node_buffer, node_writer=node_writer, **options)
    if cls is ShardedEndpoint:
        if shard is None:
            raise ValueError("strategy 'Sharded' needs its share (shard=(rank, world_size))")
        return ShardedEndpoint(module, layout, shard=shard, node_buffer=node_buffer, **options)
    endpoint: WeightEndpoint = cls(module, layout, node_buffer=node_buffer, **options)
    return endpoint
