"""The training side of a reshard (`_reshard.py` describes the protocol)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import LayoutMismatchError, SyncAbortedError, VersionError, WeightSyncError
from rlfleet.weightsync.codec._delta import DEFAULT_MAX_FRACTION, FULL
from rlfleet.weightsync.codec._delta_state import check_delta_mode
from rlfleet.weightsync.layout._dtypes import dtype_from_name
from rlfleet.weightsync.protocol._core import Pending, Status, bytes_tensor, check_version, raw_bytes
from rlfleet.weightsync.protocol._frames import Control
from rlfleet.weightsync.reshard._reshard_delta import CONTROL_TAG, MessageDeltas
from rlfleet.weightsync.reshard._reshard_groups import PeerGroup
from rlfleet.weightsync.reshard._reshard_program import GEN, TRAIN, RankProgram, ReshardMessage, Transfer
from rlfleet.weightsync.reshard._reshard_session import (
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_RESHARD_BUCKET_BYTES,
    DEFAULT_RESHARD_DIRECT_MIN,
    HEADER_TAG,
    ReshardSession,
    ReshardStats,
    encode_header,
)

__all__ = ["ReshardSender"]


class ReshardSender(ReshardSession):
    """Training side: sends this rank's slices of each version to the generation ranks that need them.

    ``send(state_dict, version, deadline, extras)`` returns once every generation rank committed
    (or raises, and none did). `state_dict` holds this rank's local shards by the names of the
    plan's training parameters (extra entries are ignored). `extras` (JSON-safe, small: e.g.
    ``{"kv_scales": {...}}``) reach every generation rank with the header. The deadline
    defaults to `DEFAULT_SYNC_TIMEOUT_S`.

    The plan's dtypes are what travels (the engine's). With ``cast=True`` a local shard in
    another floating dtype (fp32 master weights for a bf16 plan) is cast once per version,
    before any slice of it is sent, whichever generation ranks read it.

    ``delta="auto"`` sends each generation rank that holds this rank's base (the last version
    it sent and saw committed) the delta of its own messages, and the others the full bytes,
    as the broadcast sender's ``delta`` does (`_reshard_delta`: base tracking per pair, memory);
    ``delta_max_fraction``: a message whose delta is not smaller than that fraction goes full.
    """

    ROLE = TRAIN
    #: Whether shards in another floating dtype are cast to the plan's (set with ``cast=True``).
    cast = False

    def __init__(
        self,
        program: RankProgram | Mapping[str, Any] | str | bytes,
        groups: PeerGroup | Sequence[PeerGroup],
        *,
        bucket_bytes: int = DEFAULT_RESHARD_BUCKET_BYTES,
        direct_min: int = DEFAULT_RESHARD_DIRECT_MIN,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        cast: bool = False,
        delta: str = "off",
        delta_max_fraction: float = DEFAULT_MAX_FRACTION,
    ) -> None:
        mode = check_delta_mode(delta)
        super().__init__(
            program, groups, bucket_bytes=bucket_bytes, direct_min=direct_min, max_in_flight=max_in_flight
        )
        if not isinstance(cast, bool):
            raise TypeError(f"cast must be a bool, got {type(cast).__name__}")
        self.cast = cast
        #: This rank's base and per-message delta choice (None: ``delta="off"``, every pair full).
        self.delta: MessageDeltas | None = (
            None if mode == "off" else MessageDeltas(self.messages, mode, delta_max_fraction)
        )

    def send(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        deadline: Deadline | float | None = DEFAULT_SYNC_TIMEOUT_S,
        extras: Mapping[str, Any] | None = None,
    ) -> ReshardStats:
        version = check_version(version)
        deadline = Deadline.coerce(deadline)
        start = time.perf_counter()
        return self.guarded(lambda: self._send(state_dict, version, deadline, dict(extras or {}), start))

    def _check_state(self, state_dict: Mapping[str, torch.Tensor]) -> WeightSyncError | None:
        needed = {t.src_param for t in self.program.transfers}
        for name, shape, dtype in self.program.tensors:
            if name not in needed:
                continue
            tensor = state_dict.get(name)
            if tensor is None:
                return LayoutMismatchError(
                    f"train rank {self.program.rank}: parameter {name!r} is missing", name
                )
            wire = dtype_from_name(dtype)
            castable = self.cast and tensor.is_floating_point() and wire.is_floating_point
            if tuple(tensor.shape) != shape or (tensor.dtype != wire and not castable):
                return LayoutMismatchError(
                    f"train rank {self.program.rank}: parameter {name!r} is {tensor.dtype} "
                    f"{tuple(tensor.shape)}, the plan's shard is {dtype} {shape}",
                    name,
                )
        return None

    def _header(
        self, version: int, extras: dict[str, Any], problem: WeightSyncError | None
    ) -> tuple[bytes, Any]:
        """The header frame; extras that cannot travel become the problem the receivers are told."""
        digest = self.program.digest
        try:
            return encode_header(version, digest, extras, None if problem is None else str(problem)), problem
        except (TypeError, ValueError) as exc:  # extras not JSON-safe or too big: tell the receivers
            problem = SyncAbortedError(
                f"train rank {self.program.rank}: extras cannot travel in the header: {exc}"
            )
            return encode_header(version, digest, {}, str(problem)), problem

    def _send(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        deadline: Deadline,
        extras: dict[str, Any],
        start: float,
    ) -> ReshardStats:
        problem = self._check_state(state_dict)
        if problem is None and self.cast:
            state_dict = self._wire_dtypes(state_dict)
        header, problem = self._header(version, extras, problem)
        offer = None if self.delta is None or problem is not None else self.delta.offer()
        self.on_wire()
        self._send_headers(header, deadline)
        outcome, codes = self._negotiate(
            Status.ABORTED if problem else Status.OK, version, deadline, -1 if offer is None else offer
        )
        if problem is not None:
            self.in_step()  # our group does not move data: no commit round in it
            raise problem
        ok = {key for key, why in outcome.items() if why is None}
        failure: WeightSyncError | None = None
        total, sent = 0, 0
        messages = self._messages_in(ok)
        deltas = self._delta_peers()
        commit = False
        try:
            if self.delta is not None:
                self.delta.start(version, offer if deltas else None)
            if messages:
                failure, total, sent = self._send_data(state_dict, messages, deadline, deltas)
            groups = [g for g in self.groups if g.key in ok]
            problems, commit = self._commit_rounds(
                groups, Status.OK if failure is None else Status.SENDER, 0, deadline
            )
            self.in_step()
        finally:
            if self.delta is not None:
                committed = commit and failure is None and len(ok) == len(outcome)
                self.delta.finish(version, committed, messages)
        if failure is not None:
            raise failure
        bad = [f"group {k}: {why}" for k, why in outcome.items() if why is not None]
        if bad:
            message = f"version {version} not sent: {'; '.join(bad)}"
            if Status.VERSION in codes:
                raise VersionError(message)
            if Status.LAYOUT in codes or Status.PLAN in codes:
                raise LayoutMismatchError(message)
            raise SyncAbortedError(message)
        if not commit:
            raise SyncAbortedError(
                f"version {version} aborted, nothing applied: "
                f"{'; '.join(problems) or 'a generation rank voted no'}"
            )
        return ReshardStats(
            version,
            sent,
            total,
            time.perf_counter() - start,
            len(self.program.peers()),
            extras,
            base=offer if deltas else None,
            delta_peers=tuple(sorted(deltas)),
            full_bytes=sum(m.nbytes for m in messages),
        )

    def _send_headers(self, header: bytes, deadline: Deadline) -> None:
        """The header to every generation rank of each group this rank leads."""
        ops: list[tuple[Pending, str]] = []
        keep: list[torch.Tensor] = []
        for g in self.groups:
            if g.lead != self.program.rank:
                continue
            frame = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(g.wire.device)
            keep.append(frame)
            for r in g.gens:
                ops.append(
                    (g.wire.send(frame, g.members[(GEN, r)], HEADER_TAG), f"reshard header to gen rank {r}")
                )
        for op, what in ops:
            op.wait(deadline, what)

    def _wire_dtypes(self, state_dict: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The shards this rank sends, each in the plan's dtype: cast here, once per version."""
        needed = {t.src_param for t in self.program.transfers}
        out = dict(state_dict)
        with torch.no_grad():
            for name, _shape, dtype in self.program.tensors:
                wire = dtype_from_name(dtype)
                if name in needed and out[name].dtype != wire:
                    out[name] = out[name].detach().to(wire)
        return out

    def _source(self, state_dict: Mapping[str, torch.Tensor], t: Transfer) -> torch.Tensor:
        tensor = state_dict[t.src_param].detach()
        return tensor if t.dim is None else tensor.narrow(t.dim, t.src_offset, t.length)

    def _send_data(
        self,
        state_dict: Mapping[str, torch.Tensor],
        messages: list[ReshardMessage],
        deadline: Deadline,
        deltas: set[int],
    ) -> tuple[WeightSyncError | None, int, int]:
        """Post every message (at most `max_in_flight` outstanding); a message to a generation
        rank in `deltas` is preceded by its control word. A slice that cannot be read becomes
        the failure reported in the commit round; zeros keep the pair in step."""
        failure: WeightSyncError | None = None
        in_flight: deque[tuple[Pending, torch.Tensor | None, torch.Tensor, str]] = deque()
        zeros: torch.Tensor | None = None
        total = 0

        def post(op: Pending, buf: torch.Tensor | None, keep: torch.Tensor, what: str) -> None:
            while len(in_flight) >= self.max_in_flight:
                done, given, _, label = in_flight.popleft()
                done.wait(deadline, label)
                self._give(given)
            in_flight.append((op, buf, keep, what))

        with torch.no_grad():
            for msg in messages:
                group, group_rank = self._route[(GEN, msg.dst)]
                device = group.wire.device
                buf: torch.Tensor | None = None
                payload: torch.Tensor | None = None
                control: Control | None = None
                if failure is None:
                    try:
                        payload, buf = self._pack(state_dict, msg, device)
                        if msg.dst in deltas:
                            payload, buf, control = self._encoded(msg, payload, buf, device)
                        elif self.delta is not None:
                            self.delta.keep(msg, payload)
                    except Exception as exc:
                        self._give(buf)
                        payload, buf = None, None
                        name = ", ".join(sorted({t.src_param for t, _ in msg.items}))
                        failure = SyncAbortedError(
                            f"train rank {self.program.rank} failed to read {name}: "
                            f"{type(exc).__name__}: {exc}"
                        )
                        failure.__cause__ = exc
                if payload is None:  # keep the pair in step after a failure
                    if zeros is None or zeros.numel() < msg.nbytes or zeros.device != device:
                        zeros = torch.zeros(
                            max(msg.nbytes, self.bucket_bytes), dtype=torch.uint8, device=device
                        )
                    payload = zeros[: msg.nbytes]
                    control = Control(msg.index, msg.nbytes) if msg.dst in deltas else None
                what = f"reshard message {msg.index} to gen rank {msg.dst}"
                if control is not None:
                    frame = bytes_tensor(control.encode(), device)
                    post(group.wire.send(frame, group_rank, CONTROL_TAG + msg.index), None, frame, what)
                    total += int(frame.numel())
                post(group.wire.send(payload, group_rank, msg.tag), buf, payload, what)
                total += int(payload.numel())
            while in_flight:
                op, done, _, what = in_flight.popleft()
                op.wait(deadline, what)
                self._give(done)
        return failure, total, len(messages)

    def _encoded(
        self, msg: ReshardMessage, packed: torch.Tensor, buf: torch.Tensor | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None, Control]:
        """A delta pair's message: its payload (the delta, or the packed bytes when the delta is
        not small enough), the buffer to give back once sent, and its control word."""
        assert self.delta is not None
        encoded = self.delta.encode(msg, packed)
        control = Control(msg.index, encoded.nbytes, kind=encoded.kind, digest=encoded.digest)
        if encoded.kind == FULL:
            return packed, buf, control
        self._give(buf)  # the packed bytes are in the base now
        return encoded.data.to(device), None, control

    def _pack(
        self, state_dict: Mapping[str, torch.Tensor], msg: ReshardMessage, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if len(msg.items) == 1:
            own = raw_bytes(self._source(state_dict, msg.items[0][0]), device)
            if own is not None:
                return own, None
        buf = self._take(msg.nbytes, device)
        try:
            for t, offset in msg.items:
                region = self._source(state_dict, t)
                buf[offset : offset + t.nbytes].view(region.dtype).view(region.shape).copy_(region)
        except BaseException:
            self._give(buf)
            raise
        return buf[: msg.nbytes], buf
