"""Bounded-time group setup: a check-in through a TCPStore before any collective is built.

Creating a process group or an NCCL communicator blocks until every member shows up, and a
member that never comes leaves the others hanging with no word about who is missing (a common
complaint with NCCL group setup). Here each member first writes a per-rank key into a
`torch.distributed.TCPStore` and waits, against one deadline, for the keys of all the others;
at the deadline the error lists the ranks whose keys are missing. Only then is the group (or
communicator) created, when everyone is known to be there.

The store itself listens on one address (`host_store`): torch's own ``TCPStore(host, port,
is_master=True)`` listens on every interface whatever `host` says, which exposes an
unauthenticated key-value store to the whole network when the caller meant loopback.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
from collections.abc import Sequence
from datetime import timedelta
from urllib.parse import urlparse

import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore

from rlfleet.weightsync._deadline import Backoff, Deadline
from rlfleet.weightsync._errors import RendezvousTimeoutError

__all__ = [
    "RendezvousTimeoutError",
    "check_in",
    "connect_store",
    "host_store",
    "init_process_group_bounded",
    "new_group_bounded",
    "reset_group_numbering",
]

DEFAULT_GROUP_TIMEOUT_S = 300.0


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


def check_in(
    store: Store,
    prefix: str,
    rank: int,
    ranks: Sequence[int],
    deadline: Deadline | float | None,
    what: str = "rendezvous",
) -> None:
    """Announce `rank` under `prefix` and wait until every rank in `ranks` has announced itself.

    At the deadline, raise RendezvousTimeoutError naming the ranks that never checked in.
    """
    deadline = Deadline.coerce(deadline)
    store.set(f"{prefix}/{rank}", "1")
    missing = [r for r in ranks if r != rank]
    backoff = Backoff(initial=1e-3, maximum=50e-3)
    while True:
        try:
            missing = [r for r in missing if not store.check([f"{prefix}/{r}"])]
        except RuntimeError as exc:  # the store's host gave up (its own deadline) and closed it
            raise RendezvousTimeoutError(
                f"{what}: the rendezvous store closed while rank {rank} waited for rank(s) {missing} "
                f"({exc}); they did not join in time",
                missing,
            ) from exc
        if not missing:
            return
        if deadline.expired:
            joined = sorted(set(ranks) - set(missing))
            raise RendezvousTimeoutError(
                f"{what}: rank(s) {missing} did not join within {deadline.elapsed:.1f}s "
                f"(joined: {joined}, waiting on rank {rank})",
                missing,
            )
        backoff.sleep(deadline.remaining())


def init_process_group_bounded(
    backend: str,
    init_method: str,
    rank: int,
    world_size: int,
    join_timeout: float = 60.0,
    timeout: float = DEFAULT_GROUP_TIMEOUT_S,
) -> TCPStore:
    """`dist.init_process_group` that fails within `join_timeout` naming the ranks that did not join.

    Rank 0 hosts a TCPStore at `init_method` (tcp://HOST:PORT); every rank checks in there, then
    the default group is built on that store with `timeout` for its collectives. Returns the store.
    """
    host, port = _parse_tcp(init_method)
    deadline = Deadline(join_timeout)
    store = connect_store(host, port, rank, world_size, deadline)
    check_in(store, "rlfleet/init", rank, range(world_size), deadline, "init_process_group")
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
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
    check_in(
        store,
        prefix,
        dist.get_rank(),
        range(world),
        Deadline(join_timeout),
        f"new_group({ranks})",
    )
    group: dist.ProcessGroup | None = dist.new_group(
        ranks, backend=backend, timeout=timedelta(seconds=timeout)
    )
    if group is None:  # pragma: no cover - only for MPI-style backends
        raise RuntimeError(f"torch.distributed returned no group for ranks {ranks}")
    return group
