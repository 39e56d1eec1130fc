"""The worker's refit control channel (NeMo RL's ZMQ socket): JSON messages to a co-located engine.

NeMo RL hands the CUDA IPC handles of its refit buffers to a co-located engine over one ZMQ
REQ/REP socket per GPU. Here the worker binds a REQ socket that only its own user can reach:

* ``ipc://``: a Unix socket inside a private (0700) directory of its own;
* ``tcp://127.0.0.1`` (where libzmq has no ipc): loopback, which every local user can connect
  to, so the channel speaks CURVE: the worker is the CURVE client of a server key pair made for
  this channel, whose secret half is in a 0600 file in that private directory
  (`RefitChannel.credentials`); the engine connects with `connect_refit_engine(address,
  credentials)` as the CURVE server. A process of another user can neither read the key nor
  complete the handshake: it gets no request and cannot answer one.

The engine connects a REP socket to `RefitChannel.address` and answers each request. Every
frame, both ways, is one JSON object: no pickle, so a peer's bytes can never run code here; a
reply that is not exactly one JSON object is refused with `RefitChannelError`. The private
directory goes with the channel: on close, at exit, when SIGTERM/SIGHUP ends the process, and,
after a SIGKILL, when the next channel on the machine finds its creator dead. pyzmq is an
optional extra (``rlfleet-policygroup[zmq]``); without it the calls raise an ImportError that
names it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rlfleet.weightsync import (
    Deadline,
    RefitChannelError,
    SyncTimeoutError,
    process_alive,
    process_identity,
    register_termination_cleanup,
)

__all__ = ["RefitChannel", "connect_refit_engine", "import_zmq"]

ZMQ_EXTRA = "rlfleet-policygroup[zmq]"
TRANSPORTS = ("ipc", "tcp")
DEFAULT_TIMEOUT_S = 120.0  # NeMo RL's socket timeouts
MAX_FRAME_BYTES = 16 * 1024 * 1024  # handles and manifests, not weights: a larger frame is refused
MAX_POLL_MS = 60_000  # a long deadline is waited for in slices (zmq takes an int of ms)
DIR_PREFIX = "rlfleet-refit-"
_DIR_RE = re.compile(rf"^{DIR_PREFIX}(?P<pid>\d+)-(?P<start>\d+)-")


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


def _remove_stale_directories(base: str) -> list[str]:
    """Remove this user's refit directories whose creator is dead (killed before it cleaned up)."""
    removed = []
    for entry in Path(base).glob(f"{DIR_PREFIX}*"):
        match = _DIR_RE.match(entry.name)
        if match is None or entry.stat().st_uid != os.getuid():
            continue
        if not process_alive(int(match["pid"]), int(match["start"])):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def _private_directory() -> str:
    """A 0700 directory named after this process (so a later channel can tell it is stale)."""
    base = tempfile.gettempdir()
    _remove_stale_directories(base)
    pid, start = process_identity()
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{pid}-{start}-", dir=base)


def _write_private(path: str, data: Mapping[str, Any]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(dict(data), out)


def _close(socket: Any, context: Any, directory: str, unregister: Callable[[], None]) -> None:
    socket.close(linger=0)
    context.term()
    shutil.rmtree(directory, ignore_errors=True)
    unregister()


def _check_timeout(timeout_s: object, what: str) -> float:
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {timeout_s!r}")
    if not math.isfinite(timeout_s):
        raise ValueError(f"{what} must be finite (every blocking call has a deadline), got {timeout_s!r}")
    return float(timeout_s)


class RefitChannel:
    """A bound REQ socket: `request` sends one JSON object and returns the engine's JSON reply."""

    def __init__(self, name: str, transport: str = "ipc", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"refit channel transport must be one of {TRANSPORTS}, got {transport!r}")
        self.timeout_s = _check_timeout(timeout_s, "refit channel timeout_s")
        zmq = import_zmq()
        if transport == "ipc" and not zmq.has("ipc"):
            raise RefitChannelError("this libzmq has no ipc:// transport; use transport='tcp' (loopback)")
        if transport == "tcp" and not zmq.has("curve"):
            raise RefitChannelError(
                "this libzmq has no CURVE security: a loopback channel would be open to every local user"
            )
        self._zmq = zmq
        self.transport = transport
        self.requests = 0
        self.credentials: str | None = None
        self._lock = threading.Lock()
        directory = _private_directory()  # mode 0700: ours alone
        unregister = register_termination_cleanup(lambda: shutil.rmtree(directory, ignore_errors=True))
        context = zmq.Context()
        socket = context.socket(zmq.REQ)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.REQ_RELAXED, 1)  # after a timeout the next request may go out
            socket.setsockopt(zmq.REQ_CORRELATE, 1)  # and a late reply to the old one is dropped
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            if transport == "ipc":
                safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64] or "worker"
                socket.bind(f"ipc://{os.path.join(directory, safe)}.sock")
            else:
                self._secure(socket, directory)
                socket.bind("tcp://127.0.0.1:*")
            self.address: str = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            _close(socket, context, directory, unregister)
            raise
        self._socket = socket
        self._finalizer = weakref.finalize(self, _close, socket, context, directory, unregister)

    def _secure(self, socket: Any, directory: str) -> None:
        """Make `socket` the CURVE client of a key pair made for this channel; write the server's
        half where only this user can read it (the engine is the server)."""
        zmq = self._zmq
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        socket.curve_serverkey = server_public
        socket.curve_publickey = client_public
        socket.curve_secretkey = client_secret
        self.credentials = os.path.join(directory, "credentials.json")
        keys = {"server_public": server_public.decode(), "server_secret": server_secret.decode()}
        _write_private(self.credentials, keys)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def request(self, message: Mapping[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send `message` and wait for the reply, both within `timeout_s` (default: the channel's)."""
        frame = encode_frame(message)
        if timeout_s is not None:
            _check_timeout(timeout_s, "refit channel request timeout_s")
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
        """Wait for `event` until the request's own deadline (in slices zmq can take)."""
        while True:
            left = deadline.remaining()
            left = self.timeout_s if left is None else left
            if self._socket.poll(timeout=max(0, min(MAX_POLL_MS, math.ceil(left * 1000))), flags=event):
                return
            if deadline.expired or left <= 0:
                elapsed = deadline.elapsed
                raise SyncTimeoutError(f"refit channel {self.address}: {what} timed out after {elapsed:.1f}s")

    def close(self) -> None:
        """Close the socket and remove its private directory (also done when garbage collected)."""
        with self._lock:
            self._finalizer()

    def describe(self) -> dict[str, Any]:
        described = {"address": self.address, "transport": self.transport, "requests": self.requests}
        if self.credentials is not None:
            described["credentials"] = self.credentials
        return described


def connect_refit_engine(address: str, credentials: str | None = None, context: Any = None) -> Any:
    """The engine's end: a REP socket connected to a worker's refit channel at `address`.

    A ``tcp://`` channel needs the path of its `credentials` file (``get_zmq_credentials()`` on
    the worker); readable only by the user that runs both, it holds the CURVE server key the
    worker trusts. The caller answers each request with one JSON object and closes the socket.
    """
    zmq = import_zmq()
    socket = (context or zmq.Context.instance()).socket(zmq.REP)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    if address.startswith("tcp://"):
        if credentials is None:
            socket.close(linger=0)
            raise RefitChannelError(
                f"{address} is a CURVE-secured loopback channel: pass its credentials file"
            )
        with open(credentials) as keys_file:
            keys = json.load(keys_file)
        socket.curve_server = True
        socket.curve_publickey = keys["server_public"].encode()
        socket.curve_secretkey = keys["server_secret"].encode()
    socket.connect(address)
    return socket
