"""Building a CuPy NCCL communicator: the unique id's rendezvous, both CuPy signatures, a bound.

CuPy changed the unique id's type in 14: ``get_unique_id()`` returns ``bytes`` and
``NcclCommunicator(int ndev, bytes commId, int rank, NcclConfig config=None)`` takes them. Up
to 13 it returned a ``tuple`` of 128 C ``char`` values (signed on x86-64, unsigned on aarch64)
and ``NcclCommunicator(int ndev, tuple commId, int rank)`` took that. Cython checks argument
types before ``ncclCommInitRank`` runs, so `communicator` tries bytes first and falls back to
the tuple (signed, then unsigned) with nothing done by the failed tries.

The unique id travels in the roster of a `join_generation` under ``rlfleet/nccl/<name>``: the
source rank draws a fresh id for every join, so rebuilding a communicator on the same store and
name never reads the id of an earlier one (an old id makes ``ncclCommInitRank`` wait for ranks
that joined another communicator, forever).

``ncclCommInitRank`` blocks until every rank joined the id, with no timeout of its own. CuPy
offers no non-blocking init to poll and abort (its ``NcclConfig`` exposes ``split_share`` only,
not ``blocking``), so the communicator is built on a helper thread (CuPy releases the GIL around
the init) that the caller waits for against the deadline. At the deadline the caller gets a
RendezvousTimeoutError naming the ranks that never reached, or never left, the init; the thread
cannot be interrupted, stays until the init returns (or the process exits), and then aborts
the communicator it got instead of handing it to anyone.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from rlfleet.weightsync._deadline import Deadline
from rlfleet.weightsync._errors import MetadataError, WeightSyncError
from rlfleet.weightsync.dist._rendezvous import RendezvousTimeoutError, join_generation
from rlfleet.weightsync.layout._json import decode_json

__all__ = [
    "bounded_init",
    "communicator",
    "decode_unique_id",
    "encode_unique_id",
    "group_prefix",
    "join_communicator",
]

_log = logging.getLogger(__name__)

UNIQUE_ID_BYTES = 128


def encode_unique_id(uid: Any) -> str:
    """A NCCL unique id as JSON text: CuPy 14's bytes, or CuPy 13's tuple of C ``char`` values."""
    if isinstance(uid, (bytes, bytearray)):
        return json.dumps({"b64": base64.b64encode(bytes(uid)).decode()})
    return json.dumps({"ints": [int(x) for x in uid]})


def decode_unique_id(text: str | bytes) -> bytes | tuple[int, ...]:
    """Inverse of `encode_unique_id`; malformed input raises MetadataError."""
    data = decode_json(text, "NCCL unique id")
    if isinstance(data, dict) and isinstance(data.get("b64"), str):
        try:
            raw = base64.b64decode(data["b64"], validate=True)
        except ValueError as exc:  # binascii.Error
            raise MetadataError(f"NCCL unique id is not valid base64: {exc}") from None
        if len(raw) != UNIQUE_ID_BYTES:
            raise MetadataError(f"NCCL unique id must be {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        return raw
    ints = data.get("ints") if isinstance(data, dict) else None
    if (
        isinstance(ints, list)
        and len(ints) == UNIQUE_ID_BYTES
        and all(isinstance(x, int) and not isinstance(x, bool) and -128 <= x < 256 for x in ints)
    ):
        return tuple(ints)
    raise MetadataError(f"NCCL unique id must be {{'b64': ...}} or {{'ints': [{UNIQUE_ID_BYTES} ints]}}")


def communicator(nccl: Any, world_size: int, uid: bytes | tuple[int, ...], rank: int) -> Any:
    """``nccl.NcclCommunicator(world_size, id, rank)`` with the id typed as this CuPy wants it.

    Bytes first (CuPy >= 14). CuPy <= 13 refuses bytes with TypeError and takes a tuple of C
    ``char``: signed on x86-64, unsigned on aarch64, where a value out of range raises
    OverflowError while CuPy copies the id, before ``ncclCommInitRank`` runs.
    """
    raw = uid if isinstance(uid, bytes) else bytes(x & 0xFF for x in uid)
    try:
        return nccl.NcclCommunicator(world_size, raw, rank)
    except TypeError as as_bytes:
        try:
            return nccl.NcclCommunicator(world_size, tuple(b - 256 if b >= 128 else b for b in raw), rank)
        except OverflowError:
            return nccl.NcclCommunicator(world_size, tuple(raw), rank)
        except TypeError as as_tuple:  # neither signature: say what both tries said
            raise TypeError(
                f"NcclCommunicator took the unique id neither as bytes ({as_bytes}) "
                f"nor as a tuple of C chars ({as_tuple})"
            ) from as_tuple


class _InitThread(threading.Thread):
    """Runs one blocking communicator init; aborts what it built if the caller gave up first."""

    def __init__(self, build: Callable[[], Any], bind: Callable[[], None] | None, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self._build = build
        self._bind = bind
        self.lock = threading.Lock()
        self.finished = threading.Event()
        self.abandoned = False
        self.comm: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self._bind is not None:
                self._bind()  # the communicator binds to this thread's current device
            comm = self._build()
        except BaseException as exc:
            with self.lock:
                self.error = exc
                self.finished.set()
            return
        with self.lock:
            if not self.abandoned:
                self.comm = comm
                self.finished.set()
                return
        _log.warning("%s: the init completed after its caller gave up; aborting that communicator", self.name)
        with contextlib.suppress(Exception):
            comm.abort()


def bounded_init(
    build: Callable[[], Any],
    deadline: Deadline,
    what: str,
    *,
    bind: Callable[[], None] | None = None,
    missing: Callable[[], tuple[list[int], str]] | None = None,
) -> Any:
    """`build()` on a helper thread (after `bind()` there), waited for until `deadline`.

    At the deadline raise RendezvousTimeoutError; `missing()` names the ranks to blame and says
    what they did not do. An error of `build` is raised as a WeightSyncError.
    """
    worker = _InitThread(build, bind, f"rlfleet-nccl-init ({what})")
    worker.start()
    worker.finished.wait(deadline.remaining())
    with worker.lock:
        if not worker.finished.is_set():
            worker.abandoned = True
            ranks: list[int] = []
            doing = "did not finish the init"
            if missing is not None:
                with contextlib.suppress(RuntimeError):  # the store is gone too: blame no one
                    ranks, doing = missing()
            raise RendezvousTimeoutError(
                f"{what}: rank(s) {ranks} {doing} within {deadline.elapsed:.1f}s; ncclCommInitRank "
                "cannot be interrupted (CuPy offers no non-blocking init), so its thread is left "
                "behind and aborts the communicator if the init ever completes",
                ranks,
            )
    if worker.error is not None:
        raise WeightSyncError(f"{what}: ncclCommInitRank failed: {worker.error}") from worker.error
    return worker.comm


def group_prefix(name: str) -> str:
    """Where NCCL group `name` keeps its keys in the store (its `join_generation` prefix)."""
    return f"rlfleet/nccl/{name}"


def join_communicator(
    nccl: Any,
    store: Any,
    name: str,
    rank: int,
    world_size: int,
    src: int,
    deadline: Deadline,
    bind: Callable[[], None] | None = None,
) -> Any:
    """Join group `name` in `store` and build its communicator, all within `deadline`.

    Rank `src` draws the unique id, published with a fresh generation (`join_generation`); each
    rank marks when it enters and leaves the init under that generation, so a timed-out init
    names who never got there (or never got out).
    """
    prefix = group_prefix(name)
    what = f"NCCL group {name!r}"
    roster = join_generation(
        store,
        prefix,
        rank,
        range(world_size),
        deadline,
        what,
        lead=src,
        payload=lambda: encode_unique_id(nccl.get_unique_id()),
    )
    if roster.payload is None:
        raise MetadataError(f"{what}: generation {roster.generation} carries no unique id")
    uid = decode_unique_id(roster.payload)
    marks = f"{prefix}/{roster.generation}"
    others = [r for r in range(world_size) if r != rank]

    def blame() -> tuple[list[int], str]:
        absent = [r for r in others if not store.check([f"{marks}/init/{r}"])]
        if absent:
            return absent, f"never reached ncclCommInitRank of generation {roster.generation}"
        stuck = [r for r in others if not store.check([f"{marks}/ready/{r}"])] or [rank]
        return stuck, f"entered ncclCommInitRank of generation {roster.generation} but did not finish it"

    store.set(f"{marks}/init/{rank}", "1")
    comm = bounded_init(
        lambda: communicator(nccl, world_size, uid, rank), deadline, what, bind=bind, missing=blame
    )
    store.set(f"{marks}/ready/{rank}", "1")
    return comm
