"""Rendezvous: a store that listens on one address only, and group check-ins named by a key."""

from __future__ import annotations

import contextlib
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist
import weightsync_dist_workers as w
from member_workers import scenario_group_key

from rlfleet.weightsync import RendezvousTimeoutError, connect_store, host_store

LISTEN = "0A"


def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # four host-order words
    return socket.inet_ntop(socket.AF_INET6, words)


def listeners(port: int) -> set[str]:
    """Addresses with a TCP listener on `port`, read from /proc/net/tcp and tcp6."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for row in rows:
            fields = row.split()
            addr, hex_port = fields[1].split(":")
            if fields[3] == LISTEN and int(hex_port, 16) == port:
                found.add(_ip(addr))
    return found


def non_loopback_address() -> str | None:
    """An IPv4 address of this machine that is not loopback, or None."""
    candidates: list[str] = []
    with contextlib.suppress(OSError):
        candidates.append(socket.gethostbyname(socket.gethostname()))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:  # no packet is sent: connect only picks the outgoing interface
            probe.connect(("10.255.255.255", 1))
            candidates.append(probe.getsockname()[0])
        except OSError:
            pass
    return next((ip for ip in candidates if not ip.startswith("127.") and ip != "0.0.0.0"), None)


def test_host_store_listens_on_loopback_only() -> None:
    store = host_store("127.0.0.1", timeout_s=10.0)
    port = store.port
    assert port > 0
    assert listeners(port) == {"127.0.0.1"}  # not 0.0.0.0 / ::
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("from-client", "1")
    assert store.get("from-client") == b"1"
    store.set("from-host", "2")
    assert client.get("from-host") == b"2"
    with socket.create_connection(("127.0.0.1", port), timeout=5.0):
        pass


def test_host_store_is_not_reachable_on_other_addresses() -> None:
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has only a loopback address")
    store = host_store("127.0.0.1", timeout_s=10.0)
    with pytest.raises(OSError), socket.create_connection((address, store.port), timeout=5.0):
        pass
    with socket.create_connection(("127.0.0.1", store.port), timeout=5.0):
        pass


def test_host_store_on_a_taken_port_fails_clearly() -> None:
    store = host_store("127.0.0.1", timeout_s=10.0)
    with pytest.raises(OSError):
        host_store("127.0.0.1", store.port, timeout_s=2.0)
    with pytest.raises(RendezvousTimeoutError, match="could not host"):
        connect_store("127.0.0.1", store.port, 0, 2, 2.0)
    with pytest.raises(ValueError, match="port"):
        host_store("127.0.0.1", 70000)


def test_connect_store_hosts_on_the_given_address_only() -> None:
    store = connect_store("127.0.0.1", 0, 0, 1, 10.0)
    assert listeners(store.port) == {"127.0.0.1"}


@pytest.mark.timeout(150)
def test_group_key_and_reset_group_numbering() -> None:
    results = w.run_ranks(scenario_group_key, 3, w.FreshPort(), w.FreshPort(), timeout=120.0)
    for rank in range(3):
        got = results[rank]
        assert got["keyed"] == (2.0 if rank < 2 else 1.0)  # the keyed group formed and works
        # without a key the counters disagree (0 and 1 counted the first world's group)
        assert got["counted"]["type"] == "RendezvousTimeoutError", got["counted"]
        assert got["reset"] == (2.0 if rank < 2 else 1.0)  # after reset_group_numbering they agree
