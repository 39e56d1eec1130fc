"""Rendezvous: a store that listens on one address only, group check-ins named by a key, and
joins under fresh generations that stale or foreign keys cannot stand in for."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
import weightsync_dist_workers as w
from member_workers import scenario_group_key
from rendezvous_workers import scenario_member_spoofed, scenario_member_stale
from torch._C._distributed_c10d import HashStore

from rlfleet.weightsync import RendezvousTimeoutError, connect_store, host_store
from rlfleet.weightsync.dist._rendezvous import join_generation

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


# -- generations: stale and foreign check-in keys ------------------------------------------------
def test_a_rejoin_gets_a_new_generation_and_a_late_rank_is_not_split_off() -> None:
    """Threads on one store: a second join of a prefix agrees on a newer generation even when
    one rank comes late (the lead first reads that rank's check-in from the first join)."""
    store = HashStore()

    def join_all(delays: dict[int, float]) -> dict[int, Any]:
        out: dict[int, Any] = {}

        def one(rank: int) -> None:
            time.sleep(delays.get(rank, 0.0))  # this rank comes late (a slow joiner, simulated)
            out[rank] = join_generation(store, "t", rank, range(3), 30.0, "test", payload=lambda: "p")

        threads = [threading.Thread(target=one, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
        return out

    first = join_all({})
    second = join_all({2: 0.5})
    assert len({r.generation for r in first.values()}) == 1
    assert len({r.generation for r in second.values()}) == 1
    assert second[0].generation > first[0].generation
    assert {r.payload for r in second.values()} == {"p"}


def test_a_foreign_check_in_key_is_named_not_trusted() -> None:
    store = HashStore()
    store.set("t/nonce/1", "not-a-rank")
    with pytest.raises(RendezvousTimeoutError, match="did not acknowledge generation") as caught:
        join_generation(store, "t", 0, range(2), 1.0, "test")
    assert caught.value.missing_ranks == (1,)


@pytest.mark.timeout(150)
def test_a_rebuilt_member_group_names_the_member_that_stayed_away() -> None:
    """Issue 15 item 16: rank 2's keys from the first build are stale in the rebuild."""
    results = w.run_ranks(scenario_member_stale, 3, timeout=120.0)
    for rank in (0, 1):
        got = results[rank]
        assert got["first"] == 3.0
        assert got["rebuild"]["type"] == "RendezvousTimeoutError", got["rebuild"]
        assert got["rebuild"]["missing"] == [2], got["rebuild"]
        assert got["rebuild"]["seconds"] < 20.0
        assert got["again"] == 2.0, "the store and the survivors stay usable"


@pytest.mark.timeout(150)
def test_a_spoofed_check_in_key_is_named_not_a_raw_store_error() -> None:
    results = w.run_ranks(scenario_member_spoofed, 3, timeout=120.0)
    for rank in (0, 1):
        got = results[rank]["spoofed"]
        assert got["type"] == "RendezvousTimeoutError", got
        assert got["missing"] == [2], got
        assert "DistStoreError" not in got["message"]
        assert got["seconds"] < 20.0
