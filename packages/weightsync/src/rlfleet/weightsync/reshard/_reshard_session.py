"""What the reshard sender and receiver share: the header frame, the routes to peers, the pooled
message buffers and the negotiation and commit rounds (`_reshard.py` describes the protocol)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import MetadataError
from rlfleet.weightsync.protocol._core import (
    SessionState,
    decode_frame,
    encode_frame,
    int_field,
    status_round,
    status_word,
)
from rlfleet.weightsync.reshard._reshard_groups import PeerGroup
from rlfleet.weightsync.reshard._reshard_program import (
    GEN,
    RESHARD_FORMAT,
    TRAIN,
    Peer,
    RankProgram,
    ReshardMessage,
)

__all__ = [
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_RESHARD_BUCKET_BYTES",
    "DEFAULT_RESHARD_DIRECT_MIN",
    "HEADER_BYTES",
    "HEADER_TAG",
    "ReshardSession",
    "ReshardStats",
    "decode_header",
    "encode_header",
]

MAGIC = "rlfleet-reshard"
HEADER_BYTES = 4096
HEADER_TAG = 0
DEFAULT_RESHARD_BUCKET_BYTES = 16 * 1024 * 1024
DEFAULT_RESHARD_DIRECT_MIN = 1024 * 1024
DEFAULT_MAX_IN_FLIGHT = 8


def _digest_word(digest: str) -> int:
    return int.from_bytes(hashlib.sha256(digest.encode()).digest()[:7], "little")


def encode_header(version: int, digest: str, extras: Mapping[str, Any], abort: str | None) -> bytes:
    """The reshard header frame; MetadataError / TypeError if `extras` do not fit or are not JSON."""
    payload = {
        "magic": MAGIC,
        "format": RESHARD_FORMAT,
        "version": version,
        "digest": digest,
        "extras": dict(extras),
        "abort": None if abort is None else abort[:2000],
    }
    return encode_frame(payload, HEADER_BYTES, "reshard header (extras too big?)")


def decode_header(raw: bytes) -> dict[str, Any]:
    data = decode_frame(raw, HEADER_BYTES, "reshard header")
    if data.get("magic") != MAGIC or data.get("format") != RESHARD_FORMAT:
        raise MetadataError("reshard header has the wrong magic or format")
    int_field(data, "version", "reshard header")
    if not isinstance(data.get("digest"), str):
        raise MetadataError("reshard header 'digest' must be a string")
    if data.get("abort") is not None and not isinstance(data.get("abort"), str):
        raise MetadataError("reshard header 'abort' must be a string or null")
    if not isinstance(data.get("extras"), dict):
        raise MetadataError("reshard header 'extras' must be an object")
    return data


@dataclass(frozen=True)
class ReshardStats:
    """What one reshard moved on this rank."""

    version: int
    messages: int
    nbytes: int
    seconds: float
    peers: int
    extras: dict[str, Any] = field(default_factory=dict)
    #: The base the delta pairs were against (None: every pair travelled full).
    base: int | None = None
    #: The peers' ranks whose pairs travelled as deltas (`_reshard_delta`).
    delta_peers: tuple[int, ...] = ()
    #: Bytes of these messages sent full (`nbytes` counts what moved, control words included).
    full_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class ReshardSession(SessionState):
    """One rank's side of a reshard: its program, its groups and the route to each peer.

    `bucket_bytes` caps a packed message, slices of at least `direct_min` bytes travel alone,
    and at most `max_in_flight` messages are outstanding.
    """

    ROLE: ClassVar[str]

    def __init__(
        self,
        program: RankProgram | Mapping[str, Any] | str | bytes,
        groups: PeerGroup | Sequence[PeerGroup],
        *,
        bucket_bytes: int = DEFAULT_RESHARD_BUCKET_BYTES,
        direct_min: int = DEFAULT_RESHARD_DIRECT_MIN,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
    ) -> None:
        super().__init__()
        self.program = RankProgram.coerce(program)
        if self.program.role != self.ROLE:
            raise ValueError(
                f"{type(self).__name__} runs a {self.ROLE} program, got a {self.program.role} one"
            )
        if bucket_bytes < 1 or direct_min < 1 or max_in_flight < 1:
            raise ValueError("bucket_bytes, direct_min and max_in_flight must be positive")
        self.groups = self._my_groups(groups)
        self._route = self._routes()
        self.bucket_bytes = bucket_bytes
        self.direct_min = direct_min
        self.max_in_flight = max_in_flight
        self.messages = self.program.messages(bucket_bytes, direct_min)
        #: Size of a pooled message buffer: the largest message that may need one, at most a bucket.
        self._buf_bytes = min(bucket_bytes, max((m.nbytes for m in self.messages), default=0))
        self._digest_word = _digest_word(self.program.digest)
        self._pool: list[torch.Tensor] = []
        self._decide = True
        self._held_here = -1
        self._peer_held: dict[Peer, int] = {}

    def _my_groups(self, groups: PeerGroup | Sequence[PeerGroup]) -> list[PeerGroup]:
        ordered = sorted([groups] if isinstance(groups, PeerGroup) else list(groups), key=lambda g: g.key)
        if len({g.key for g in ordered}) != len(ordered):
            raise ValueError("peer groups need distinct keys")
        me = self.program.me
        mine = [g for g in ordered if me in g.members]
        if not mine:
            raise ValueError(f"{me[0]} rank {me[1]} is in none of the given peer groups")
        for g in mine:
            if g.members[me] != g.wire.rank:
                raise ValueError(
                    f"group {g.key}: {me[0]} rank {me[1]} is listed as group rank {g.members[me]}, "
                    f"but this process is group rank {g.wire.rank}"
                )
        return mine

    def _routes(self) -> dict[Peer, tuple[PeerGroup, int]]:
        """The group (and group rank) through which each peer of this rank is reached."""
        me = self.program.me
        route: dict[Peer, tuple[PeerGroup, int]] = {}
        for peer in self.program.peers():
            for g in self.groups:
                if peer in g.members:
                    route[peer] = (g, g.members[peer])
                    break
            else:
                raise ValueError(f"{peer[0]} rank {peer[1]} shares no peer group with {me[0]} rank {me[1]}")
        return route

    def release_buffers(self) -> None:
        self._pool = []

    def _take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if nbytes <= self._buf_bytes:
            for i, buf in enumerate(self._pool):
                if buf.device == device:
                    return self._pool.pop(i)
            return torch.empty(self._buf_bytes, dtype=torch.uint8, device=device)
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def _give(self, buf: torch.Tensor | None) -> None:
        if buf is not None and buf.numel() == self._buf_bytes and len(self._pool) < self.max_in_flight + 1:
            self._pool.append(buf)

    def _peer_of(self, msg: ReshardMessage) -> Peer:
        return (GEN, msg.dst) if self.program.role == TRAIN else (TRAIN, msg.src)

    def _messages_in(self, ok: set[int]) -> list[ReshardMessage]:
        """This rank's messages whose group agreed to move data."""
        return [m for m in self.messages if self._route[self._peer_of(m)][0].key in ok]

    # -- rounds -------------------------------------------------------------------------------
    def _round(
        self, group: PeerGroup, parts: Sequence[int], deadline: Deadline, what: str
    ) -> list[list[int]]:
        return status_round(group.wire, parts, deadline, f"{what} in group {group.key}")

    def _negotiate(
        self, code: int, version: int, deadline: Deadline, held: int = -1
    ) -> tuple[dict[int, str | None], list[int]]:
        """Per group: None if it agreed, else why not; plus every code seen.

        Generation ranks also report how many groups they are in (every generation rank is in
        every group): with one group, everybody sees the same commit statuses and the decision
        round is skipped (`_decide`). Every member reports the version it `held` as a delta's
        base (-1: none), kept per peer for `_delta_peers` (`_reshard_delta`).
        """
        outcome: dict[int, str | None] = {}
        seen: list[int] = []
        groups_here = len(self.groups) if self.program.role == GEN else 0
        self._decide = False
        self._held_here = held
        self._peer_held = {}
        for g in self.groups:
            codes, versions, digests, counts, bases = self._round(
                g, (code, version, self._digest_word, groups_here, held), deadline, "negotiation"
            )
            for i, base in enumerate(bases):
                self._peer_held[g.labels[i]] = base
            seen.extend(codes)
            self._decide = self._decide or max(counts) > 1
            problems = [f"{g.label(i)} {status_word(c)}" for i, c in enumerate(codes) if c]
            if len(set(digests)) > 1:
                problems.append("members execute different plans (digests differ)")
            if not problems and len(set(versions)) > 1:
                problems.append(
                    "members disagree on the version: "
                    + ", ".join(f"{g.label(i)} v{v}" for i, v in enumerate(versions))
                )
            outcome[g.key] = "; ".join(problems) if problems else None
        return outcome, seen

    def _delta_peers(self) -> set[int]:
        """The peers (their ranks) that reported the same base as this rank in the negotiation:
        the pairs that travel as deltas."""
        held = self._held_here
        if held < 0:
            return set()
        peers = self.program.peers()
        return {rank for side, rank in peers if self._peer_held.get((side, rank), -1) == held}

    def _commit_rounds(
        self, ok_groups: Iterable[PeerGroup], code: int, vote: int, deadline: Deadline
    ) -> tuple[list[str], bool]:
        """Status round in every usable group; with several groups, then the generation ranks'
        decision round (a training rank sees only its own group's statuses)."""
        groups = list(ok_groups)
        problems: list[str] = []
        for g in groups:
            (codes,) = self._round(g, (code,), deadline, "commit status")
            problems += [f"{g.label(i)} {status_word(c)}" for i, c in enumerate(codes) if c]
        if not self._decide:
            return sorted(set(problems)), not problems and vote == 0
        if self.program.role == GEN and problems:
            vote = 1
        commit = True
        for g in groups:
            (votes,) = self._round(g, (vote,), deadline, "commit decision")
            if any(votes[g.members[(GEN, r)]] for r in g.gens):
                commit = False
        return sorted(set(problems)), commit
