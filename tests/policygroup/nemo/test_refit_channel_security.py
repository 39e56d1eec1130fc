"""The refit control channel is reachable by its owner only, has honest deadlines and leaves no
private directory behind (real processes; the other user is uid 65534, run with the system
Python and its standard library only, since it cannot read our environment)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from rlfleet.policygroup.nemo import RefitChannel
from rlfleet.weightsync import SyncTimeoutError

zmq = pytest.importorskip("zmq")
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"

ENGINE = textwrap.dedent(
    """
    import json, sys, time
    from rlfleet.policygroup.nemo import connect_refit_engine
    address, credentials, delay = sys.argv[1], sys.argv[2] if sys.argv[2] != "-" else None, float(sys.argv[3])
    socket = connect_refit_engine(address, credentials)
    if not socket.poll(60_000):
        raise SystemExit("no request")
    request = json.loads(socket.recv())
    time.sleep(delay)  # an engine that takes its time to answer
    socket.send_json({"type": "ack", "echo": request})
    socket.close(linger=0)
    """
)

INTRUDER = textwrap.dedent(
    """
    import json, os, socket, sys
    host, port, credentials = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    out = {"uid": os.getuid()}
    try:
        open(credentials).read()
        out["read_keys"] = True
    except PermissionError:
        out["read_keys"] = False
    conn = socket.create_connection((host, port), timeout=5)
    # a ZMTP 3.0 REP peer with the NULL mechanism: greeting, then READY (what an unsecured
    # loopback channel would accept, and then route requests to)
    conn.sendall(bytes([0xFF] + [0] * 8 + [0x7F, 3, 0]) + b"NULL" + bytes(16) + bytes([0]) + bytes(31))
    prop = bytes([11]) + b"Socket-Type" + (3).to_bytes(4, "big") + b"REP"
    body = bytes([5]) + b"READY" + prop
    conn.sendall(bytes([0x04, len(body)]) + body)
    conn.settimeout(3)
    got = b""
    try:
        while len(got) < 1 << 16:
            chunk = conn.recv(4096)
            if not chunk:
                break
            got += chunk
    except OSError:
        pass
    out["bytes"] = got.hex()
    print(json.dumps(out), flush=True)
    """
)


def _engine(address: str, credentials: str | None, delay: float = 0.0) -> subprocess.Popen[str]:
    args = [sys.executable, "-c", ENGINE, address, credentials or "-", str(delay)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_loopback_channel_admits_only_the_engine_holding_its_keys() -> None:
    channel = RefitChannel("gpu-0", transport="tcp", timeout_s=30)
    try:
        assert channel.address.startswith("tcp://127.0.0.1:")
        assert channel.credentials is not None
        keys, directory = Path(channel.credentials), Path(channel.credentials).parent
        assert stat.S_IMODE(keys.stat().st_mode) == 0o600
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700
        engine = _engine(channel.address, channel.credentials)
        reply = channel.request({"type": "hello", "handle": "secret-handle-123"}, timeout_s=60)
        assert reply == {"type": "ack", "echo": {"type": "hello", "handle": "secret-handle-123"}}
        assert engine.wait(60) == 0
    finally:
        channel.close()


@pytest.mark.skipif(
    os.getuid() != 0 or not os.path.exists(SYSTEM_PYTHON), reason="needs root to run a process as nobody"
)
def test_another_user_gets_no_request_and_cannot_answer_one() -> None:
    channel = RefitChannel("gpu-0", transport="tcp", timeout_s=30)
    try:
        assert channel.credentials is not None
        host, port = channel.address.removeprefix("tcp://").rsplit(":", 1)
        intruder = subprocess.Popen(
            [SYSTEM_PYTHON, "-I", "-c", INTRUDER, host, port, channel.credentials],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            user=NOBODY,
            group=NOBODY,
            cwd="/",
        )
        with pytest.raises(SyncTimeoutError, match="waiting for an engine to connect"):
            channel.request({"type": "hello", "handle": "secret-handle-123"}, timeout_s=2)
        out, err = intruder.communicate(timeout=60)
        seen = json.loads(out)
        assert seen["uid"] == NOBODY, err
        assert seen["read_keys"] is False
        assert b"secret-handle-123" not in bytes.fromhex(seen["bytes"])
        # a plain (keyless) engine of our own user is refused the same way
        plain = _engine(channel.address, None)
        assert plain.wait(60) != 0  # connect_refit_engine refuses a tcp address without keys
    finally:
        channel.close()


def test_a_request_waits_for_its_own_deadline_not_the_channels() -> None:
    channel = RefitChannel("gpu-0", transport="ipc", timeout_s=0.5)
    try:
        engine = _engine(channel.address, None, delay=1.5)
        assert channel.request({"type": "slow"}, timeout_s=30)["type"] == "ack"
        assert engine.wait(60) == 0
    finally:
        channel.close()


def test_deadlines_are_finite_and_large_ones_work() -> None:
    for bad in (float("inf"), float("nan"), 0, -1):
        with pytest.raises(ValueError, match="timeout_s"):
            RefitChannel("gpu-0", timeout_s=bad)
    with contextlib.closing(RefitChannel("gpu-0", timeout_s=1e10)) as channel:
        with pytest.raises(ValueError, match="finite"):
            channel.request({"type": "x"}, timeout_s=float("inf"))
        with pytest.raises(SyncTimeoutError):
            channel.request({"type": "x"}, timeout_s=0.2)  # nobody connected: its own deadline


CHILD = textwrap.dedent(
    """
    import sys, time
    from rlfleet.policygroup.nemo import RefitChannel
    channel = RefitChannel("gpu-0", transport=sys.argv[1])
    print(channel.address, flush=True)
    time.sleep(120)
    """
)


def _private_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("rlfleet-refit-*")}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_sigterm_removes_the_private_directory(transport: str) -> None:
    before = _private_dirs()
    child = subprocess.Popen([sys.executable, "-c", CHILD, transport], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    child.stdout.readline()
    made = _private_dirs() - before
    assert len(made) == 1
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == -signal.SIGTERM  # it dies of the signal, as without us
    assert not (made & _private_dirs())


def test_a_killed_workers_directory_goes_with_the_next_channel() -> None:
    before = _private_dirs()
    child = subprocess.Popen([sys.executable, "-c", CHILD, "ipc"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    child.stdout.readline()
    made = _private_dirs() - before
    child.kill()
    child.wait(60)
    assert made <= _private_dirs()  # SIGKILL: nothing could clean up
    RefitChannel("gpu-1").close()  # the next channel on the machine sweeps dead creators' dirs
    assert not (made & _private_dirs())
