"""A worker's part of a weight sync: the calls the driver makes for each step of a `SyncPlan`.

A worker class inherits `WeightCalls` (policygroup's `BasePolicy` does). Per step the driver
calls one ``sync_*`` method on each process taking part (`rlfleet.policygroup.sync`):
``sync_publish`` (a trainer writes its node's buffer),
``sync_send`` (a trainer broadcasts its share of the buckets), ``sync_receive`` (a rollout
worker receives every broadcast addressed to it: one part per sender, assembled into one
version under the two-phase commit), ``sync_stage`` (a rollout worker takes the version from
its node's buffer) and, for a "cuda_ipc" step, ``sync_ipc_channel`` then ``sync_ipc_send`` (a
trainer: its CUDA IPC channel to the step's readers, then the version through it) and
``sync_ipc_receive`` (a reader, attached to that channel, into its endpoint). A non-blocking
sync (`PolicyGroup.sync_weights(block=False)`) first asks each sending trainer for a snapshot
(``sync_snapshot``, which returns once it is queued; ``wait_snapshot``; `_snapshots`), and its
steps then send that snapshot, never the live weights. Each takes the
sync's one deadline (a wall-clock time every step shares) and returns what it measured: start
and end (``time.time()``) and its phases; ``sync_send`` also what its broadcast put on the
wire (bytes, full bytes, a delta's base, the world ranks that lacked it), for the `SyncReport`.
They call the overridable methods below (`publish_shared`, `send_broadcast`, `recv_broadcast`,
`stage_from_segment`, `send_ipc`, `recv_ipc`), so a policy that writes its node buffer its own
way keeps working.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch

from rlfleet.placement import CallKind, CallResult, PartResult, WireResult
from rlfleet.policygroup.worker._host import WorkerHost
from rlfleet.weightsync import (
    DTYPES,
    Deadline,
    DiscardingConsumer,
    SharesReceiver,
    SyncTimeoutError,
    WeightEndpoint,
    WorkerWeights,
    measure_copy_terms,
    probe_layout,
)

Timed = CallResult  # the executor contract: placement's `CallResult`, what `sync_report` reads


def left_until(deadline_at: float, what: str) -> float:
    """Seconds until the sync's wall-clock deadline; SyncTimeoutError once it passed."""
    left = deadline_at - time.time()
    if left <= 0:
        raise SyncTimeoutError(f"{what}: the sync's deadline passed {-left:.2f}s before this step began")
    return left


def timed(fn: Callable[[], Any], phase: str | None = None) -> Timed:
    """Run `fn`; its value, wall-clock start and end, and (`phase`) its duration as that phase."""
    t0 = time.time()
    value = fn()
    t1 = time.time()
    out: Timed = {"t0": t0, "t1": t1, "phases": {}}
    if isinstance(value, Mapping) and "phases" in value:
        out["value"] = value.get("value")
        out["phases"] = {str(k): float(v) for k, v in value["phases"].items()}
        out["parts"] = {str(k): cast(PartResult, dict(v)) for k, v in value.get("parts", {}).items()}
    else:
        out["value"] = value
    if phase is not None:
        out["phases"][phase] = t1 - t0
    return out


class WeightCalls(WorkerHost):
    """Receiving, staging, applying and sending weights (for a worker class to inherit)."""

    # Provided by the host class, besides what `WorkerHost` declares.
    _refuse_if_restarted: Callable[[], None]
    get_state_dict: Callable[[], dict[str, torch.Tensor]]
    load_state_dict: Callable[[Mapping[str, torch.Tensor]], None]

    def _version_live(self) -> None:
        """A host's new-version hook (`BasePolicy.on_weight_version`), run once per version."""

    def _live(self, out: Timed) -> Timed:
        self._version_live()
        return out

    @property
    def weights(self) -> WorkerWeights:
        """This worker's weightsync state: the node buffer it writes (``node_writer``) and the
        buffers versions land in (``consumers()``); the hook tests and fault injection use."""
        return self._weights

    # ================================================================== the sync's steps (timed)
    def sync_publish(self, version: int, deadline_at: float, *_after: Any) -> Timed:
        """A node_buffer step's writer: this version into the node's buffer, once (a non-blocking
        sync's snapshot already put it there)."""
        left = left_until(deadline_at, "publish into the node buffer")
        if self._snapshots.require(version, "publish"):  # the snapshot was this publish

            def published() -> int:  # not again through publish_shared: a newer snapshot may
                self._snapshots.wait(version, Deadline(left))  # hold the writer, waiting for
                return version  # the swap this very sync makes

            return timed(published, "pack")
        return timed(lambda: self.publish_shared(version, left), "pack")

    def sync_send(
        self, group_id: str, version: int, buckets: Sequence[int] | None, deadline_at: float, *_after: Any
    ) -> Timed:
        """A broadcast step's sender: `buckets` (None: all) of this version to the group."""
        left = left_until(deadline_at, f"broadcast in {group_id}")
        size = self.config.weight_buffer.bucket_bytes
        out = timed(lambda: self.send_broadcast(group_id, version, size, left, buckets=buckets), "wire")
        sent = self._comm.take_sent(group_id, version)
        if sent is not None:  # the executor names the ranks that lacked the base (`lacking`)
            out["wire"] = cast(WireResult, sent)
        return out

    def sync_snapshot(
        self, version: int, slot: int, kinds: Sequence[str], deadline_at: float, asker: str = ""
    ) -> float:
        """A non-blocking sync's first call on a sending trainer: queue the snapshot of `version`
        into snapshot `slot` ("publish": into the node buffer; "copy": a private copy) and return
        at once (when it was queued): from now on `wait_for_weight_snapshot` waits for it.
        `asker` is the asking group's token (its `train` calls count the snapshots it asked)."""
        left = max(0.0, deadline_at - time.time())  # a passed deadline fails the snapshot, counted
        self._snapshots.start(
            version, slot, tuple(kinds), Deadline(left), lambda: self.model, self.publish_shared, asker
        )
        return time.time()

    def wait_snapshot(self, version: int, timeout_s: float) -> bool:
        """Block until the snapshot of `version` is taken (its error raised); False if none was asked."""
        return self._snapshots.wait(version, Deadline(timeout_s))

    def wait_for_weight_snapshot(self, timeout_s: float | None = None) -> None:
        """The fence before changing the weights (`BasePolicy` runs it before each optimizer step):
        wait for the snapshots non-blocking syncs queued (bounded by ``sync_timeout_s``)."""
        if self._snapshots.pending:
            self._snapshots.fence(Deadline(self.config.sync_timeout_s if timeout_s is None else timeout_s))

    def sync_receive(
        self, parts: Sequence[Mapping[str, Any]], version: int, deadline_at: float, *_after: Any
    ) -> Timed:
        """Every broadcast step this rollout worker receives: one part per sender (group id,
        sender's world rank, sender id, its buckets), assembled into one version."""
        left = left_until(deadline_at, "receive")
        return self._live(timed(lambda: self.recv_broadcast(parts, version, left)))

    def sync_stage(self, name: str, version: int, deadline_at: float, *_after: Any) -> Timed:
        """A node_buffer step's reader: this version out of the node's buffer `name`."""
        left = left_until(deadline_at, f"read node buffer {name}")
        return self._live(timed(lambda: self.stage_from_segment(name, version, timeout_s=left), "land"))

    def sync_ipc_channel(
        self, readers: Sequence[str], backend: str, bucket_bytes: int, checksums: bool
    ) -> str:
        """A cuda_ipc step's writer: the name of its IPC channel to `readers` (made at first use,
        kept while the readers, the group's layout, the backend and checksums stay the same); the
        weight buffer's ``delta`` mode reaches it (``"auto"``: deltas when every reader holds the base)."""
        delta = getattr(self.config.weight_buffer, "delta", "off")
        wire = getattr(self.config.weight_buffer, "wire_dtype", None)  # the readers serve it
        return self._weights.ipc_channel(self.model, readers, backend, bucket_bytes, checksums, delta, wire)

    def sync_ipc_send(self, channel: str, version: int, deadline_at: float, *_after: Any) -> Timed:
        """A cuda_ipc step's writer: this version through `channel`, until every reader committed."""
        left = left_until(deadline_at, f"send through IPC channel {channel}")
        out = timed(lambda: self.send_ipc(channel, version, left), "wire")
        sent = self._weights.ipc_writer.last_wire(channel, version)
        if sent is not None:  # a delta channel: what its slots carried, for the `SyncReport`
            out["wire"] = cast(WireResult, sent)
        return out

    def sync_ipc_receive(
        self, channel: str, index: int, version: int, deadline_at: float, *_after: Any
    ) -> Timed:
        """A cuda_ipc step's reader `index`: this version from `channel` into our endpoint."""
        left = left_until(deadline_at, f"receive from IPC channel {channel}")
        return self._live(timed(lambda: self.recv_ipc(channel, index, version, left), "land"))

    # ================================================================== calibration probes
    def probe_copy_terms(self) -> dict[str, float]:
        """Host copy rate and per-tensor, per-bucket seconds of small syncs in this process."""
        return measure_copy_terms()

    def probe_broadcast(
        self, group_id: str, src_rank: int, nbytes: int, version: int, timeout_s: float
    ) -> float:
        """One version of `nbytes` through the broadcast protocol in `group_id`; seconds here."""
        layout, state = probe_layout(nbytes, self.config.weight_buffer.bucket_bytes)
        deadline = Deadline(timeout_s)
        start = time.perf_counter()
        if self._comm.rank == src_rank:
            self._comm.sender(group_id, layout).send(state, version, deadline)
        else:
            self._comm.receiver(group_id, layout, src_rank).receive(
                DiscardingConsumer(layout, version), deadline
            )
        return time.perf_counter() - start

    # ================================================================== endpoints and node buffers
    def init_weight_buffer(
        self,
        shared_weight_buffer: Mapping[str, Any] | None = None,
        *,
        strategy: str | None = None,
        layout: Mapping[str, Any] | None = None,
    ) -> None:
        """Receive with `strategy` from now on (default: "Shared" given a node buffer, else the config's).

        `layout` is the trainers' (ours must equal it; an error names the first parameter that
        differs). `shared_weight_buffer["name"]` names the node's buffer, which "Shared" binds to
        zero-copy and the other strategies copy each version out of; "Sharded" also needs
        ``{"rank": r, "world_size": n}`` (this worker's share of each version).
        """
        if strategy is None:
            default = self.config.weight_buffer.buffer_strategy
            strategy = "Shared" if shared_weight_buffer is not None else default
        wire = getattr(self.config.weight_buffer, "wire_dtype", None)
        if wire is not None:  # serve what travels: the trainers cast to it while packing
            self.model.to(DTYPES[wire])
        self._weights.init_endpoint(self.model, strategy, shared_weight_buffer, layout)
        self._restarted = False

    def create_shared_writer(
        self, layout: Mapping[str, Any], num_readers: int, prefix: str = "rlfleet", checksums: bool = False
    ) -> str:
        """Become the writer of this node's buffer (two slots); returns its name for the readers."""
        return self._weights.create_writer(layout, num_readers, prefix, checksums)

    # ================================================================== moving bytes
    def publish_shared(self, version: int, timeout_s: float) -> int:
        """Trainer on the node: write this version once into the node's buffer."""
        return self._weights.publish(self.model, version, timeout_s)

    def send_broadcast(
        self,
        group_id: str,
        version: int,
        bucket_bytes: int,
        timeout_s: float,
        *,
        buckets: Sequence[int] | None = None,
    ) -> int:
        """Broadcast `buckets` (None: all) of this trainer's weights in group `group_id` (we are the
        root); returns the bytes sent (fewer than the full version's when a delta went)."""
        wire = getattr(self.config.weight_buffer, "wire_dtype", None)
        layout = self._weights.layout_for(self.model, bucket_bytes, wire)
        sender = self._comm.sender(group_id, layout, getattr(self.config.weight_buffer, "delta", "off"))
        deadline = Deadline(timeout_s)
        weights = self._snapshots.copy_for(version, deadline)  # a non-blocking sync's snapshot
        stats = sender.send(
            self.model.state_dict() if weights is None else weights, version, deadline, buckets=buckets
        )
        last = None if sender.delta is None else sender.delta.last
        if stats.base is not None and last is not None and last.sent_bytes >= last.full_bytes:
            stats = dataclasses.replace(stats, base=None)  # every bucket went full: no delta sent
        self._comm.sent[(group_id, version)] = stats  # what went on the wire: the step's report
        return int(stats.wire_bytes)

    def send_ipc(self, channel: str, version: int, timeout_s: float) -> int:
        """Send this version of our weights through our IPC channel `channel`; bytes moved."""
        deadline = Deadline(timeout_s)
        weights = self._snapshots.copy_for(version, deadline)  # a non-blocking sync's snapshot
        if weights is not None:
            return self._weights.ipc_writer.send(channel, weights, version, deadline)
        return self._weights.ipc_send(self.model, channel, version, deadline)

    def recv_ipc(self, channel: str, index: int, version: int, timeout_s: float) -> int:
        """Take `version` from IPC channel `channel` as its reader `index` (staged, or applied for "None")."""
        self._receiving()
        return self._weights.ipc_receive(self.model, channel, index, version, Deadline(timeout_s))

    def send_weights_ipc(self) -> dict[str, torch.Tensor]:
        """Colocated seed path: a CPU copy of the state dict (travels through the object store)."""
        return self.get_state_dict()

    def _receiving(self) -> WeightEndpoint:
        self._refuse_if_restarted()
        return self._weights.require_endpoint()

    def stage_from_segment(
        self, name: str, version: int, *_after: Any, timeout_s: float | None = None
    ) -> int:
        """Take `version` from this node's buffer `name` (`_after`: the call that fills it)."""
        timeout = self.config.sync_timeout_s if timeout_s is None else timeout_s
        return int(self._receiving().stage_from_node(name, version, timeout))

    def recv_broadcast(
        self, parts: Sequence[Mapping[str, Any]], version: int, timeout_s: float
    ) -> dict[str, Any]:
        """Receive `version` from every sender in `parts`, then stage it; per part what it measured."""
        endpoint = self._receiving()
        receiver = SharesReceiver(
            [
                (
                    str(p["sender"]),
                    self._comm.receiver(str(p["group"]), endpoint.layout, int(p["src_rank"])),
                    p.get("buckets"),
                )
                for p in parts
            ]
        )
        value = endpoint.receive(receiver, version, Deadline(timeout_s))
        return {"value": int(value), "phases": receiver.phases(), "parts": receiver.part_phases()}

    def recv_weights_ipc(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Colocated seed path: load a state dict that came through the object store."""
        with self._serve.exclusive(self.config.drain_timeout_s):
            self.load_state_dict(state)
            self._weights.version = self._weights.version + 1 if version is None else int(version)
        self._version_live()
        return self._weights.version

    # ================================================================== applying
    def apply_staged(
        self, version: int | None = None, timeout_s: float | None = None, group_id: str | None = None
    ) -> int:
        """Make the staged version live (`group_id`: the node's gather group, "Sharded")."""
        endpoint = self._weights.endpoint
        if endpoint is None:
            return self._weights.version
        group = None if group_id is None else self._comm.group(group_id)
        applied = int(endpoint.apply(version, timeout_s or self.config.drain_timeout_s, group))
        self._version_live()
        return applied

    def notify_update_weights(self) -> int:
        """Seed call: new weights are staged; apply them now (the group drains us first)."""
        return self.apply_staged()

    def wait_for_weight_update_done(self, timeout: float = 60.0) -> bool:
        """True once no received version is waiting to be applied (False on timeout)."""
        endpoint = self._weights.endpoint
        return True if endpoint is None else bool(endpoint.wait_applied(timeout))

    def get_staged_version(self) -> int | None:
        endpoint = self._weights.endpoint
        return None if endpoint is None else endpoint.staged_version


#: The executor contract: the worker method each of placement's call kinds runs (`CALL_KINDS`);
#: policygroup's executor dispatches through this table, and a test checks it against the
#: arguments the executor passes and the `CallResult` every method returns.
STEP_CALLS: dict[CallKind, Callable[..., CallResult]] = {
    "publish": WeightCalls.sync_publish,
    "send": WeightCalls.sync_send,
    "receive": WeightCalls.sync_receive,
    "stage": WeightCalls.sync_stage,
    "ipc_send": WeightCalls.sync_ipc_send,
    "ipc_receive": WeightCalls.sync_ipc_receive,
}
