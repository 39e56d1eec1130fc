"""The training side of a reshard (`_reshard.py` describes the protocol)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rlfleet.weightsync._deadline import DEFAULT_SYNC_TIMEOUT_S, Deadline
from rlfleet.weightsync._errors import LayoutMismatchError, SyncAbortedError, VersionError, WeightSyncError
from rlfleet.weightsync.layout._dtypes import dtype_from_name
from rlfleet.weightsync.protocol._core import Pending, Status, check_version, raw_bytes
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
    ) -> None:
        super().__init__(
            program, groups, bucket_bytes=bucket_bytes, direct_min=direct_min, max_in_flight=max_in_flight
        )
        if not isinstance(cast, bool):
            raise TypeError(f"cast must be a bool, got {type(cast).__name__}")
        self.cast = cast

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
        self.on_wire()
        self._send_headers(header, deadline)
        outcome, codes = self._negotiate(Status.ABORTED if problem else Status.OK, version, deadline)
        if problem is not None:
            self.in_step()  # our group does not move data: no commit round in it
            raise problem
        ok = {key for key, why in outcome.items() if why is None}
        failure: WeightSyncError | None = None
        total, sent = 0, 0
        messages = self._messages_in(ok)
        if messages:
            failure, total, sent = self._send_data(state_dict, messages, deadline)
        groups = [g for g in self.groups if g.key in ok]
        problems, commit = self._commit_rounds(
            groups, Status.OK if failure is None else Status.SENDER, 0, deadline
        )
        self.in_step()
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
            version, sent, total, time.perf_counter() - start, len(self.program.peers()), extras
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
        self, state_dict: Mapping[str, torch.Tensor], messages: list[ReshardMessage], deadline: Deadline
    ) -> tuple[WeightSyncError | None, int, int]:
        """Post every message (at most `max_in_flight` outstanding). A slice that cannot be read
        becomes the failure reported in the commit round; zeros keep the pair in step."""
        failure: WeightSyncError | None = None
        in_flight: deque[tuple[Pending, torch.Tensor | None, str]] = deque()
        zeros: torch.Tensor | None = None
        total = 0
        with torch.no_grad():
            for msg in messages:
                while len(in_flight) >= self.max_in_flight:
                    op, done, what = in_flight.popleft()
                    op.wait(deadline, what)
                    self._give(done)
                group, group_rank = self._route[(GEN, msg.dst)]
                device = group.wire.device
                buf: torch.Tensor | None = None
                payload: torch.Tensor | None = None
                if failure is None:
                    try:
                        payload, buf = self._pack(state_dict, msg, device)
                    except Exception as exc:
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
                what = f"reshard message {msg.index} to gen rank {msg.dst}"
                in_flight.append((group.wire.send(payload, group_rank, msg.tag), buf, what))
                total += msg.nbytes
            while in_flight:
                op, done, what = in_flight.popleft()
                op.wait(deadline, what)
                self._give(done)
        return failure, total, len(messages)

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
