"""The worker's refit control channel (NeMo RL's ZMQ socket): JSON messages to a co-located engine.

NeMo RL hands the CUDA IPC handles of its refit buffers to a co-located engine over one ZMQ
REQ/REP socket per GPU. Here the worker binds a REQ socket at an ``ipc://`` path inside a
private (0700) directory of its own, or on loopback TCP, never on another interface; the engine
connects a REP socket to `RefitChannel.address` and answers each request. Every frame, both
ways, is one JSON object: no pickle, so a peer's bytes can never run code here; a reply that is
not exactly one JSON object is refused with `RefitChannelError`. pyzmq is an optional extra
(``rlfleet-policygroup[zmq]``); without it the calls raise an ImportError that names it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Mapping
from typing import Any

from rlfleet.weightsync import Deadline, RefitChannelError, SyncTimeoutError

__all__ = ["RefitChannel", "import_zmq"]

ZMQ_EXTRA = "rlfleet-policygroup[zmq]"
TRANSPORTS = ("ipc", "tcp")
DEFAULT_TIMEOUT_S = 120.0  # NeMo RL's socket timeouts
MAX_FRAME_BYTES = 16 * 1024 * 1024  # handles and manifests, not weights: a larger frame is refused


def import_zmq() -> Any:
    """pyzmq, or an ImportError that says how to install it."""
    try:
        import zmq
    except ImportError as exc:
        raise ImportError(
            f"the refit control channel (maybe_init_zmq / get_zmq_address) needs pyzmq: "
            f'pip install "{ZMQ_EXTRA}" ({exc})'
        ) from exc
    return zmq


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """`message` as one JSON frame (RefitChannelError if it is not a JSON-safe object)."""
    if not isinstance(message, Mapping):
        raise RefitChannelError(f"refit channel messages are JSON objects, got {type(message).__name__}")
    try:
        frame = json.dumps(dict(message), allow_nan=False, separators=(",", ":")).encode()
    except (TypeError, ValueError) as exc:
        raise RefitChannelError(f"refit channel message is not JSON-safe: {exc}") from None
    if len(frame) > MAX_FRAME_BYTES:
        raise RefitChannelError(f"refit channel message is {len(frame)} bytes, over {MAX_FRAME_BYTES}")
    return frame


def decode_frame(frames: list[bytes], peer: str) -> dict[str, Any]:
    """The JSON object in a reply; RefitChannelError if it is anything else (pickle included)."""
    if len(frames) != 1:
        raise RefitChannelError(f"{peer} sent {len(frames)} frames; a reply is exactly one JSON frame")
    raw = frames[0]
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise RefitChannelError(
            f"{peer} sent a frame that is not JSON ({len(raw)} bytes starting {raw[:16]!r}): {exc}; "
            "refit channel frames are JSON only (never pickle)"
        ) from None
    if not isinstance(value, dict):
        raise RefitChannelError(f"{peer} sent JSON {type(value).__name__}; a reply must be a JSON object")
    return value


def _close(socket: Any, context: Any, directory: str | None) -> None:
    socket.close(linger=0)
    context.term()
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)


class RefitChannel:
    """A bound REQ socket: `request` sends one JSON object and returns the engine's JSON reply."""

    def __init__(self, name: str, transport: str = "ipc", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"refit channel transport must be one of {TRANSPORTS}, got {transport!r}")
        zmq = import_zmq()
        if transport == "ipc" and not zmq.has("ipc"):
            raise RefitChannelError("this libzmq has no ipc:// transport; use transport='tcp' (loopback)")
        self._zmq = zmq
        self.transport = transport
        self.timeout_s = timeout_s
        self.requests = 0
        self._lock = threading.Lock()
        context = zmq.Context()
        socket = context.socket(zmq.REQ)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.REQ_RELAXED, 1)  # after a timeout the next request may go out
        socket.setsockopt(zmq.REQ_CORRELATE, 1)  # and a late reply to the old one is dropped
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        directory = None
        try:
            if transport == "ipc":
                directory = tempfile.mkdtemp(prefix="rlfleet-refit-")  # mode 0700: ours alone
                safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "worker"
                socket.bind(f"ipc://{os.path.join(directory, safe)}.sock")
            else:
                socket.bind("tcp://127.0.0.1:*")
            self.address: str = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            _close(socket, context, directory)
            raise
        self._socket = socket
        self._finalizer = weakref.finalize(self, _close, socket, context, directory)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def request(self, message: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send `message` and wait for the reply, both within `timeout_s` (default: the channel's)."""
        frame = encode_frame(message)
        deadline = Deadline(self.timeout_s if timeout_s is None else timeout_s)
        zmq = self._zmq
        with self._lock:
            if self.closed:
                raise RefitChannelError(f"refit channel {self.address} is closed")
            self._poll(zmq.POLLOUT, deadline, "waiting for an engine to connect")
            self._socket.send(frame)
            self._poll(zmq.POLLIN, deadline, "waiting for the engine's reply")
            frames = self._socket.recv_multipart()
            self.requests += 1
        return decode_frame(frames, f"the engine on {self.address}")

    def _poll(self, event: int, deadline: Deadline, what: str) -> None:
        left = deadline.remaining_or(self.timeout_s)
        if not self._socket.poll(timeout=int(left * 1000), flags=event):
            elapsed = deadline.elapsed
            raise SyncTimeoutError(f"refit channel {self.address}: {what} timed out after {elapsed:.1f}s")

    def close(self) -> None:
        """Close the socket and remove its private directory (also done when garbage collected)."""
        with self._lock:
            self._finalizer()

    def describe(self) -> dict[str, Any]:
        return {"address": self.address, "transport": self.transport, "requests": self.requests}
