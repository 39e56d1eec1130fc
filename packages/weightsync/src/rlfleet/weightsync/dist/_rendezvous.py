"""Bounded-time group setup: a check-in through a TCPStore before any collective is built.

Creating a process group or an NCCL communicator blocks until every member shows up, and a
member that never comes leaves the others hanging with no word about who is missing (a common
complaint with NCCL group setup). Here each member first writes a per-rank key into a
`torch.distributed.TCPStore` and waits, against one deadline, for the keys of all the others;
at the deadline the error lists the ranks whose keys are missing. Only then is the group (or
communicator) created, when everyone is known to be there.

A prefix that is joined more than once (a group rebuilt on the same store and name, which is
what our own errors advise) must not trust keys an earlier join left behind, nor keys someone
else wrote: `join_generation` gives every join a fresh generation, agreed by every rank through
random nonces, and the group then builds under ``f"{prefix}/{generation}/"``.

The store itself listens on one address (`host_store`): torch's own ``TCPStore(host, port,
is_master=True)`` listens on every interface whatever `host` says, which exposes an
unauthenticated key-value store to the whole network when the caller meant loopback.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import secrets
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlparse

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import (
    MetadataError,
    RendezvousTimeoutError,
    WeightSyncError,
)
from rlfleet.weightsync.layout._json import decode_json

__all__ = [
    "RendezvousTimeoutError",
    "Roster",
    "build_group",
    "connect_store",
    "generation_store",
    "host_store",
    "init_process_group_bounded",
    "join_generation",
    "new_group_bounded",
    "reset_group_numbering",
]

DEFAULT_GROUP_TIMEOUT_S = 300.0

_T = TypeVar("_T")


def _parse_tcp(init_method: str) -> tuple[str, int]:
    parsed = urlparse(init_method)
    if parsed.scheme != "tcp" or not parsed.hostname or not parsed.port:
        raise ValueError(f"init_method must look like tcp://HOST:PORT, got {init_method!r}")
    return parsed.hostname, parsed.port


def host_store(
    host: str, port: int = 0, *, world_size: int | None = None, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S
) -> TCPStore:
    """Host a TCPStore that listens on `host`:`port` only (port 0: any free port, see ``.port``).

    We bind the listening socket ourselves, to exactly that address, and hand it to the store
    (torch's master binds the wildcard address whatever host it is given). `world_size` and
    `timeout_s` are the store's own (the timeout bounds its clients' waits).
    """
    if not host:
        raise ValueError("host_store needs an address to listen on, got an empty host")
    if not 0 <= port < 65536:
        raise ValueError(f"port must be in [0, 65536), got {port}")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    if not infos:  # pragma: no cover - getaddrinfo raises rather than return nothing
        raise OSError(f"no address for host {host!r}")
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:  # "::1" means ::1, not also the IPv4 side
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(1024)
        bound_port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns the listening socket from here on
    try:
        return TCPStore(
            host,
            bound_port,
            world_size,
            True,
            timeout=timedelta(seconds=max(timeout_s, 0.001)),
            wait_for_workers=False,
            master_listen_fd=fd,
            use_libuv=True,
        )
    except BaseException:
        with contextlib.suppress(OSError):
            socket.close(fd)
        raise


def connect_store(
    host: str, port: int, rank: int, world_size: int, deadline: Deadline | float | None, host_rank: int = 0
) -> TCPStore:
    """Host (rank `host_rank`) or reach the TCPStore at host:port within the deadline.

    The host rank listens on `host` only (`host_store`), not on every interface.
    """
    deadline = Deadline.coerce(deadline)
    seconds = deadline.remaining_or(DEFAULT_GROUP_TIMEOUT_S)
    # A client's connect makes two tries of `timeout` each: halve it to stay inside the deadline.
    per_try = seconds if rank == host_rank else seconds / 2
    try:
        if rank == host_rank:
            return host_store(host, port, world_size=world_size, timeout_s=per_try)
        return TCPStore(
            host,
            port,
            world_size,
            is_master=False,
            timeout=timedelta(seconds=max(per_try, 0.001)),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as exc:  # DistNetworkError / DistStoreError; bind errors
        if rank == host_rank:
            raise RendezvousTimeoutError(
                f"rank {rank} could not host the rendezvous store on {host}:{port}: {exc}", []
            ) from exc
        raise RendezvousTimeoutError(
            f"rank {rank} could not reach the rendezvous store at {host}:{port} within {seconds:.1f}s: "
            f"rank {host_rank}, which hosts it, did not join ({exc})",
            [host_rank],
        ) from exc


class _Waiting:
    """One rank waiting on other ranks' keys in a store under a deadline: every error it raises
    is a RendezvousTimeoutError naming the ranks still missing."""

    def __init__(self, store: Store, rank: int, deadline: Deadline, what: str) -> None:
        self.store, self.rank, self.deadline, self.what = store, rank, deadline, what
        self.unconfirmed: list[int] = []
        self.backoff = Backoff(initial=1e-3, maximum=50e-3)

    def wait(self, missing: list[int], doing: str) -> None:
        """Sleep a little, or raise RendezvousTimeoutError naming `missing` at the deadline."""
        self.unconfirmed = missing
        if self.deadline.expired:
            raise RendezvousTimeoutError(
                f"{self.what}: rank(s) {missing} {doing} within {self.deadline.elapsed:.1f}s "
                f"(rank {self.rank} waiting)",
                missing,
            )
        self.backoff.sleep(self.deadline.remaining())

    def until_present(self, key: Callable[[int], str], ranks: list[int], doing: str) -> None:
        """Wait until ``key(r)`` is in the store for every rank `r` of `ranks`."""
        missing = self.unconfirmed = ranks
        while missing := [r for r in missing if not self.store.check([key(r)])]:
            self.wait(missing, doing)

    @contextlib.contextmanager
    def store_errors(self) -> Iterator[None]:
        """A failed or closed store (its host gave up, or died) names the ranks still awaited."""
        try:
            yield
        except WeightSyncError:
            raise
        except RuntimeError as exc:  # DistStoreError / DistNetworkError
            raise RendezvousTimeoutError(
                f"{self.what}: the rendezvous store failed while rank {self.rank} waited for rank(s) "
                f"{self.unconfirmed} ({exc})",
                self.unconfirmed,
            ) from exc


@dataclass(frozen=True)
class Roster:
    """What the ranks of one `join_generation` agreed on."""

    #: Never used before by a join of the same prefix in the same store (the store's counter).
    generation: int
    #: What the lead published with this generation (e.g. an NCCL unique id), or None.
    payload: str | None


class _Join(_Waiting):
    """One rank's side of `join_generation` (keys, reads, and the errors that name ranks)."""

    def __init__(
        self, store: Store, prefix: str, rank: int, ranks: list[int], lead: int, deadline: Deadline, what: str
    ) -> None:
        super().__init__(store, rank, deadline, what)
        self.prefix, self.ranks, self.lead = prefix, ranks, lead
        self.nonce = secrets.token_hex(16)  # this join's check-in: no earlier or foreign key matches it
        self.unconfirmed = [r for r in ranks if r != rank]

    def nonce_key(self, rank: int) -> str:
        return f"{self.prefix}/nonce/{rank}"

    def ack_key(self, generation: int, rank: int) -> str:
        return f"{self.prefix}/{generation}/ack/{rank}"

    def read(self, key: str) -> str | None:
        if not self.store.check([key]):
            return None
        return bytes(self.store.get(key)).decode("utf-8", "replace")

    def run_lead(self, payload: Callable[[], str] | None) -> Roster:
        """Publish rosters until every rank acknowledged one with its own nonce, then say go."""
        data = None if payload is None else payload()
        others = [r for r in self.ranks if r != self.rank]
        self.until_present(self.nonce_key, others, "did not check in")
        while True:
            nonces = {r: self.read(self.nonce_key(r)) or "" for r in others}
            nonces[self.rank] = self.nonce
            generation = int(self.store.add(f"{self.prefix}/generation", 1))
            roster = {"generation": generation, "nonces": {str(r): n for r, n in nonces.items()}}
            self.store.set(f"{self.prefix}/roster", json.dumps({**roster, "payload": data}))
            self.store.set(self.ack_key(generation, self.rank), self.nonce)
            rechecked = self._acknowledged(generation, nonces, others)
            if not rechecked:
                self.store.set(f"{self.prefix}/{generation}/go", self.nonce)
                return Roster(generation, data)
            # those ranks replaced a stale nonce after it was read: publish a new generation
            self.wait(rechecked, "checked in again but acknowledged no generation")

    def _acknowledged(self, generation: int, nonces: dict[int, str], others: list[int]) -> list[int]:
        """Wait until every rank acknowledged `generation` ([]), or return those that checked in anew."""
        pending = others
        while pending := [r for r in pending if self.read(self.ack_key(generation, r)) != nonces[r]]:
            rechecked = [r for r in pending if self.read(self.nonce_key(r)) != nonces[r]]
            if rechecked:
                return rechecked
            doing = f"did not acknowledge generation {generation} (stale or foreign check-in keys?)"
            self.wait(pending, doing)
        return []

    def run_follower(self) -> Roster:
        """Acknowledge the newest roster that carries this rank's nonce; return once it says go."""
        acked: dict[str, Any] | None = None
        while True:
            roster = self._roster()
            if roster is not None and (acked is None or roster["generation"] != acked["generation"]):
                self.store.set(self.ack_key(roster["generation"], self.rank), self.nonce)
                acked = roster
                self.backoff.reset()
            if acked is not None and self.store.check([f"{self.prefix}/{acked['generation']}/go"]):
                return Roster(acked["generation"], acked["payload"])
            self.wait(*self._follower_missing(acked))

    def _roster(self) -> dict[str, Any] | None:
        """The published roster if it is well formed and names this rank's nonce, else None."""
        raw = self.read(f"{self.prefix}/roster")
        if raw is None:
            return None
        try:
            data = decode_json(raw, "rendezvous roster")
        except MetadataError:
            return None  # not a roster of ours: keep waiting for the lead's
        if (
            not isinstance(data, dict)
            or not isinstance(data.get("generation"), int)
            or not isinstance(data.get("nonces"), dict)
            or not isinstance(data.get("payload"), (str, type(None)))
            or data["nonces"].get(str(self.rank)) != self.nonce
        ):
            return None
        return data

    def _follower_missing(self, acked: dict[str, Any] | None) -> tuple[list[int], str]:
        if acked is None:
            absent = [r for r in self.ranks if r != self.rank and not self.store.check([self.nonce_key(r)])]
            if absent:
                return absent, "did not check in"
            return [self.lead], "(the lead) published no roster with this rank's check-in"
        generation, nonces = acked["generation"], acked["nonces"]
        silent = [
            r
            for r in self.ranks
            if r != self.rank and self.read(self.ack_key(generation, r)) != nonces.get(str(r))
        ]
        if silent:
            return silent, f"did not acknowledge generation {generation}"
        return [self.lead], f"(the lead) never confirmed generation {generation}"


def join_generation(
    store: Store,
    prefix: str,
    rank: int,
    ranks: Sequence[int],
    deadline: Deadline | float | None,
    what: str = "rendezvous",
    *,
    lead: int | None = None,
    payload: Callable[[], str] | None = None,
) -> Roster:
    """Check in under `prefix` for a fresh generation that every rank in `ranks` agrees on.

    Every rank writes a fresh random nonce; the lead (the lowest rank unless given) publishes a
    roster (a new generation from the store's counter, each rank's nonce, and `payload()`,
    computed once on the lead) and says go once every rank acknowledged it with its own nonce.
    A check-in key left by an earlier join of this prefix, or written by anyone else, carries a
    nonce that no rank acknowledges: the join fails at the deadline with RendezvousTimeoutError
    naming that rank, rather than going ahead without it; a rank that checks in after its stale
    key was read gets a new generation. Build the group under ``f"{prefix}/{generation}/"``
    so that a rebuild never reads keys of an earlier one.
    """
    members = [int(r) for r in ranks]
    lead = min(members, default=rank) if lead is None else lead
    if len(set(members)) != len(members) or rank not in members or lead not in members:
        raise ValueError(f"{what}: rank {rank} and lead {lead} must be among distinct ranks {members}")
    join = _Join(store, prefix, rank, members, lead, Deadline.coerce(deadline), what)
    with join.store_errors():
        store.set(join.nonce_key(rank), join.nonce)
        return join.run_lead(payload) if rank == lead else join.run_follower()


def generation_store(store: Store, prefix: str, roster: Roster) -> Store:
    """The keys of one generation's group: ``f"{prefix}/{generation}/pg/"`` in `store`."""
    return PrefixStore(f"{prefix}/{roster.generation}/pg/", store)


def build_group(build: Callable[[], _T], what: str, roster: Roster) -> _T:
    """Run a group's own connect after `join_generation`; its store or connect errors (a rank
    that died after joining) become RendezvousTimeoutError instead of a raw DistStoreError."""
    try:
        return build()
    except WeightSyncError:
        raise
    except RuntimeError as exc:  # DistStoreError / DistNetworkError / gloo's connect errors
        raise RendezvousTimeoutError(
            f"{what}: every rank joined generation {roster.generation}, but building the group "
            f"failed (a rank may have died since it joined): {exc}",
            [],
        ) from exc


def init_process_group_bounded(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    join_timeout: float = 60.0,
    timeout: float = DEFAULT_GROUP_TIMEOUT_S,
) -> TCPStore:
    """`dist.init_process_group` that fails within `join_timeout` naming the ranks that did not join.

    Rank 0 hosts a TCPStore at `init_method` (tcp://HOST:PORT); every rank joins a fresh
    generation there (`join_generation`), then the default group is built under that generation's
    keys with `timeout` for its collectives. Returns the store.
    """
    host, port = _parse_tcp(init_method)
    deadline = Deadline(join_timeout)
    store = connect_store(host, port, rank, world_size, deadline)
    what = "init_process_group"
    roster = join_generation(store, "rlfleet/init", rank, range(world_size), deadline, what)
    build_group(
        lambda: dist.init_process_group(
            backend,
            store=generation_store(store, "rlfleet/init", roster),
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        ),
        what,
        roster,
    )
    return store


_group_seq_lock = threading.Lock()
_group_seq: dict[tuple[int, ...], itertools.count[int]] = {}


def reset_group_numbering() -> None:
    """Forget how many groups `new_group_bounded` made per member set (without a `key`).

    Call it after destroying the default group and building a new one, on every rank, when the
    new world's groups are created without a `key`: their check-in keys then count from 0 again
    in every process, including ones that were not in the old world.
    """
    with _group_seq_lock:
        _group_seq.clear()


def new_group_bounded(
    ranks: Sequence[int],
    backend: str | None = None,
    timeout: float = DEFAULT_GROUP_TIMEOUT_S,
    join_timeout: float = 60.0,
    key: str | None = None,
) -> dist.ProcessGroup:
    """`dist.new_group` that fails within `join_timeout` naming the ranks that did not call it.

    Like `dist.new_group`, every process of the default group calls it, in the same order.
    The check-in happens under a name every process must agree on: `key` when given (the same
    string on every rank, unique among the groups made in this default group's store), else a
    per-process count of the groups made for this member set, which only agrees if every
    process counted the same calls (see `reset_group_numbering` after re-creating the world).
    """
    if not dist.is_initialized():
        raise RuntimeError("new_group_bounded needs an initialized default process group")
    ranks = sorted(int(r) for r in ranks)
    world = dist.get_world_size()
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or len(set(ranks)) != len(ranks):
        raise ValueError(f"group ranks must be distinct ranks of the world (size {world}), got {ranks}")
    members = "-".join(map(str, ranks))
    if key is not None:
        if not isinstance(key, str) or not key:
            raise ValueError(f"group key must be a non-empty string, got {key!r}")
        prefix = f"rlfleet/group/{members}/key/{key}"
    else:
        with _group_seq_lock:  # per member set, so one failed call does not shift the keys of others
            seq = next(_group_seq.setdefault(tuple(ranks), itertools.count()))
        prefix = f"rlfleet/group/{members}/{seq}"
    store = dist.distributed_c10d._get_default_store()
    what = f"new_group({ranks})"
    roster = join_generation(store, prefix, dist.get_rank(), range(world), Deadline(join_timeout), what)
    group: dist.ProcessGroup | None = build_group(
        lambda: dist.new_group(ranks, backend=backend, timeout=timedelta(seconds=timeout)), what, roster
    )
    if group is None:  # pragma: no cover - only for MPI-style backends
        raise RuntimeError(f"torch.distributed returned no group for ranks {ranks}")
    return group
