"""The protocol core that the broadcast and the reshard protocols share.

Both are the same state machine over different collectives: a fixed-size JSON frame announces
a version, a sum all-reduce of one status code per rank negotiates it, the data moves, and a
second status round votes on the commit. What is common lives here once: the status codes and
the words that name them, the fixed-size JSON frames and their field checks, the status
rounds, the version check, the session's "broken" state, and the consumer calls that must not
hide the sync's own error (`safe_abort`) or fail after the vote (`prepare`).

A session is *in step* when every rank left the protocol after the same collective (a clean
failure: a stale version, a layout mismatch, a consumer that failed, a vote against the
commit); the group is then reusable. Any other exit (a timeout, a lost peer, garbage on the
wire) leaves the group mid-collective: the session is *broken* and refuses reuse.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from typing import Any, Protocol, TypeVar

import torch

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import MetadataError, SyncAbortedError, VersionError, WeightSyncError
from rlfleet.weightsync.layout._json import decode_json
from rlfleet.weightsync.protocol._protocol import BucketConsumer

_log = logging.getLogger(__name__)

#: Largest version a sync can carry: every control block and status round holds it in an int64.
MAX_VERSION = 2**63 - 1
MAX_REASON_CHARS = 300

T = TypeVar("T")


class Status(IntEnum):
    """Per-rank outcome codes exchanged in the negotiation and commit rounds."""

    OK = 0
    LAYOUT = 1
    VERSION = 2
    CHECKSUM = 3
    CONSUMER = 4
    ABORTED = 5
    PLAN = 6
    SENDER = 7
    COMMIT = 8
    SHARE = 9


_STATUS_WORDS = {
    Status.OK: "ok",
    Status.LAYOUT: "has a different layout",
    Status.VERSION: "rejected the version",
    Status.CHECKSUM: "saw a checksum mismatch",
    Status.CONSUMER: "failed to take the version",
    Status.ABORTED: "aborted",
    Status.PLAN: "executes a different plan",
    Status.SENDER: "failed to read its weights",
    Status.COMMIT: "could not prepare its commit",
    Status.SHARE: "expects a different share of buckets",
}


def status_word(code: int) -> str:
    """What a rank that reported `code` did, as words after its name."""
    try:
        return _STATUS_WORDS[Status(code)]
    except ValueError:
        return f"reported unknown status {code}"


def describe(codes: Sequence[int], label: Callable[[int], str], skip: int | None = None) -> str:
    """The ranks that reported a problem, by name: "rank 2 rejected the version, ..."."""
    parts = [f"{label(rank)} {status_word(code)}" for rank, code in enumerate(codes) if code and rank != skip]
    return ", ".join(parts) or "no rank reported a problem"


def check_version(version: object) -> int:
    """`version` if it is an int in [0, 2**63); else `VersionError` (before anything is sent)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise VersionError(f"version must be an int, got {type(version).__name__} {version!r:.40}")
    if not 0 <= version <= MAX_VERSION:
        raise VersionError(f"version {version} is outside [0, 2**63): it cannot travel as an int64")
    return version


# -- fixed-size JSON frames --------------------------------------------------------------------
def truncate(text: str, limit: int = MAX_REASON_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def encode_frame(payload: Mapping[str, Any], size: int, what: str) -> bytes:
    """`payload` as compact JSON, zero-padded to exactly `size` bytes (MetadataError if larger)."""
    raw = json.dumps(payload, separators=(",", ":")).encode()
    if len(raw) > size:
        raise MetadataError(f"{what} is {len(raw)} bytes, over its fixed {size}-byte frame")
    return raw + b"\0" * (size - len(raw))


def decode_frame(raw: bytes, size: int, what: str) -> dict[str, Any]:
    """The JSON object in a fixed-size frame; MetadataError for anything else."""
    if len(raw) != size:
        raise MetadataError(f"{what} frame is {len(raw)} bytes, expected {size}")
    data = decode_json(raw.rstrip(b"\0"), what)
    if not isinstance(data, dict):
        raise MetadataError(f"{what} must be a JSON object, got {type(data).__name__}")
    return data


def int_field(
    data: Mapping[str, Any], key: str, what: str, minimum: int = 0, maximum: int = MAX_VERSION
) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise MetadataError(
            f"{what}: field {key!r} must be an int in [{minimum}, {maximum}], got {value!r:.80}"
        )
    return value


def reason_field(data: Mapping[str, Any], what: str) -> str | None:
    value = data.get("abort")
    if value is not None and not isinstance(value, str):
        raise MetadataError(f"{what}: field 'abort' must be a string or null")
    return value


def bytes_tensor(raw: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.cpu().numpy().tobytes())


def raw_bytes(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """`tensor`'s own storage as flat bytes on `device`, or None if it has to be copied first.

    A conjugate or negative view holds bytes that are not its values (the bit is applied when
    it is read), so it is copied like a non-contiguous one.
    """
    if not tensor.is_contiguous() or tensor.device != device or tensor.is_conj() or tensor.is_neg():
        return None
    return tensor.detach().reshape(-1).view(torch.uint8)


# -- status rounds ------------------------------------------------------------------------------
class Pending(Protocol):
    """An operation in flight on a wire."""

    def wait(self, deadline: Deadline, what: str) -> None:
        """Block until done; raise SyncTimeoutError / PeerLostError (mapped) on failure."""
        ...


class Collective(Protocol):
    """What a status round needs from a wire: the group, its device and a sum all-reduce."""

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        ...

    @property
    def size(self) -> int: ...

    def all_reduce_sum(self, tensor: torch.Tensor) -> Pending: ...


def status_round(wire: Collective, parts: Sequence[int], deadline: Deadline, what: str) -> list[list[int]]:
    """One sum all-reduce of one int64 per rank per part; each part as a per-rank list."""
    n = wire.size
    vec = torch.zeros(len(parts) * n, dtype=torch.int64)
    for i, value in enumerate(parts):
        vec[i * n + wire.rank] = int(value)
    vec = vec.to(wire.device)
    wire.all_reduce_sum(vec).wait(deadline, what)
    values = [int(v) for v in vec.cpu().tolist()]
    return [values[i * n : (i + 1) * n] for i in range(len(parts))]


# -- session state ------------------------------------------------------------------------------
class SessionState:
    """Whether a session's group can be used again, and the guard that decides it.

    Every sync runs inside `guarded`. The protocol calls `on_wire()` before its first
    collective and `in_step()` wherever every rank leaves after the same collective; an
    exception raised between the two leaves the group mid-collective, and the session refuses
    further syncs. Errors before the first collective (bad arguments) leave it usable.
    """

    def __init__(self) -> None:
        self._broken: str | None = None
        self._in_step = True

    @property
    def broken(self) -> str | None:
        """Why the group can no longer be used (a timeout or a lost peer left it mid-collective)."""
        return self._broken

    def on_wire(self) -> None:
        """From here until `in_step`, an exception leaves the group mid-collective."""
        self._in_step = False

    def in_step(self) -> None:
        """Every rank is past the same collective: an exception from here leaves the group usable."""
        self._in_step = True

    def guarded(self, run: Callable[[], T]) -> T:
        if self._broken is not None:
            raise SyncAbortedError(
                f"this transport broke in an earlier sync ({self._broken}); "
                "rebuild its process group / communicator before syncing again"
            )
        self._in_step = True
        try:
            return run()
        except BaseException as exc:
            if not self._in_step:
                self._broken = f"{type(exc).__name__}: {truncate(str(exc), 200)}"
            raise


# -- consumer calls -----------------------------------------------------------------------------
def consumer_error(error: BaseException, what: str) -> WeightSyncError:
    """A consumer's failure as a WeightSyncError that never reads as a transport failure."""
    if isinstance(error, WeightSyncError) and not isinstance(error, MetadataError):
        return error
    wrapped = SyncAbortedError(f"{what}: {type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def prepare(consumer: BucketConsumer, version: int, deadline: Deadline, who: str) -> WeightSyncError | None:
    """Let `consumer` acquire what its commit needs, before this rank votes; the error, or None.

    Consumers without ``prepare_commit`` are committed as before (their commit runs after the
    vote). The prepare may take most, not all, of what is left of the sync: the vote that
    follows still needs a moment, and a vote that misses the deadline would break the group.
    """
    hook = getattr(consumer, "prepare_commit", None)
    if hook is None:
        return None
    try:
        hook(version, before_vote(deadline))
    except Exception as exc:
        return consumer_error(exc, f"{who} could not prepare the commit of version {version}")
    return None


def before_vote(deadline: Deadline) -> Deadline:
    """What of `deadline` a consumer hook may take when a status round follows it (the begin
    before the negotiation, the prepare before the commit vote): most, not all, of what is left,
    since a round that misses the deadline breaks the group."""
    left = deadline.remaining()
    return deadline.leaving(0.0 if left is None else min(2.0, 0.25 * left))


def safe_abort(consumer: BucketConsumer, error: BaseException) -> None:
    """``consumer.abort(error)``; a failing abort is logged, never raised over the sync's error."""
    try:
        consumer.abort(error)
    except Exception:
        _log.exception("consumer.abort failed")
