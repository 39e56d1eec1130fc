"""`maybe_init_zmq` / `get_zmq_address` (NeMo RL): the worker's refit control channel.

A real peer process (`zmq_peer.py`) connects to the address and exchanges JSON; a reply that is
not one JSON object is refused; the channel is private (ipc:// in a 0700 directory, or loopback
TCP); without pyzmq the calls name the extra to install.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pg_policies import Tiny

from rlfleet.policygroup import PolicyConfig, RefitChannelError
from rlfleet.policygroup.nemo import RefitChannel
from rlfleet.weightsync import SyncTimeoutError

pytest.importorskip("zmq")
PEER = Path(__file__).resolve().parents[1] / "zmq_peer.py"


@pytest.fixture
def policy() -> Iterator[Tiny]:
    worker = Tiny(PolicyConfig(), role="train", device="cpu")
    yield worker
    channel = worker.__dict__.get("_refit_channel_socket")
    if channel is not None:
        channel.close()


def peer(address: str, *modes: str, credentials: str | None = None) -> subprocess.Popen[str]:
    """`zmq_peer.py` answering `modes`; a loopback (tcp://) channel's peer needs its `credentials`."""
    command = [sys.executable, str(PEER), address, *modes]
    env = {**os.environ, "REFIT_CREDENTIALS": credentials} if credentials else None
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finished(proc: subprocess.Popen[str]) -> list[dict[str, Any]]:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def test_the_address_is_private_and_stable(policy: Tiny) -> None:
    policy.maybe_init_zmq()
    address = policy.get_zmq_address()
    assert address == policy.get_zmq_address()  # initialised once
    assert address.startswith("ipc://")
    directory = os.path.dirname(address[len("ipc://") :])
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    state = policy._refit_transport_state("zmq")
    assert json.loads(json.dumps(state)) == {"address": address, "transport": "ipc", "requests": 0}


@pytest.mark.timeout(120)
def test_a_peer_process_exchanges_a_json_handshake(policy: Tiny) -> None:
    proc = peer(policy.get_zmq_address(), "hello", "hello")
    for n in (1, 2):
        reply = policy.zmq_request({"type": "hello", "worker": "trainer 0", "n": n}, timeout_s=60)
        echo = {"type": "hello", "worker": "trainer 0", "n": n}
        assert reply == {"type": "hello", "engine": "peer", "echo": echo}
    seen = finished(proc)
    assert [s["request"]["n"] for s in seen] == [1, 2]
    assert policy._refit_transport_state("zmq")["requests"] == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("mode", "match"),
    [("pickle", "not JSON .*never pickle"), ("multi", "2 frames"), ("array", "must be a JSON object")],
)
def test_a_reply_that_is_not_one_json_object_is_refused(policy: Tiny, mode: str, match: str) -> None:
    proc = peer(policy.get_zmq_address(), mode, "hello")
    with pytest.raises(RefitChannelError, match=match):
        policy.zmq_request({"type": "handles"}, timeout_s=60)
    assert policy.zmq_request({"type": "hello"}, timeout_s=60)["type"] == "hello"  # still usable
    finished(proc)


@pytest.mark.timeout(120)
def test_a_silent_peer_times_out_and_the_channel_recovers(policy: Tiny) -> None:
    with pytest.raises(SyncTimeoutError, match="waiting for an engine to connect"):
        policy.zmq_request({"type": "hello"}, timeout_s=0.2)  # nobody connected yet
    proc = peer(policy.get_zmq_address(), "silent", "hello")
    with pytest.raises(SyncTimeoutError, match="reply"):
        policy.zmq_request({"type": "hello", "n": 1}, timeout_s=3)
    assert policy.zmq_request({"type": "hello", "n": 2}, timeout_s=60)["echo"]["n"] == 2
    assert [s["request"]["n"] for s in finished(proc)] == [1, 2]


def test_messages_must_be_json_safe(policy: Tiny) -> None:
    for bad in ({"t": torch.zeros(1)}, {"x": float("nan")}, ["not", "an", "object"]):
        with pytest.raises(RefitChannelError):
            policy.zmq_request(bad, timeout_s=0.1)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_loopback_tcp_channel() -> None:
    channel = RefitChannel("tcp-worker", transport="tcp")
    try:
        assert channel.address.startswith("tcp://127.0.0.1:")
        proc = peer(channel.address, "hello", credentials=channel.credentials)
        assert channel.request({"type": "hello"}, timeout_s=60)["engine"] == "peer"
        finished(proc)
    finally:
        channel.close()
    assert channel.closed
    with pytest.raises(ValueError, match="transport"):
        RefitChannel("x", transport="tcp://0.0.0.0")


def test_closing_removes_the_private_directory() -> None:
    channel = RefitChannel("ipc-worker")
    directory = os.path.dirname(channel.address[len("ipc://") :])
    assert os.path.isdir(directory)
    channel.close()
    assert not os.path.exists(directory)
    with pytest.raises(RefitChannelError, match="closed"):
        channel.request({"type": "hello"})


def test_without_pyzmq_the_calls_name_the_extra() -> None:
    script = textwrap.dedent(
        """
        import sys
        sys.modules["zmq"] = None  # pyzmq not installed
        import torch
        from rlfleet.policygroup import BasePolicy

        class Tiny(BasePolicy):
            def build_model(self):
                return torch.nn.Linear(2, 2)

        policy = Tiny(role="train", device="cpu")
        for call in (policy.maybe_init_zmq, policy.get_zmq_address):
            try:
                call()
            except ImportError as exc:
                print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stderr
    assert all('pip install "rlfleet-policygroup[zmq]"' in line for line in lines)
