"""Process bodies for the commit-protocol tests (spawned, so they live in an importable module).

They run under `weightsync_dist_workers.run_ranks`: a commit that cannot go through (a stuck
request holds the serving lock), versions and views the sender must refuse or send exactly,
and one version assembled from two senders, each sending half the buckets in its own group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import weightsync_dist_workers as w
from member_workers import finish, member_store

from rlfleet.weightsync import (
    Assembly,
    BroadcastReceiver,
    BroadcastSender,
    DoubleBuffer,
    Layout,
    MemberGroup,
    RecordingConsumer,
    SharesReceiver,
    checksum,
)

DEADLINE = 30.0
COMMIT_TIMEOUT = 1.0


def _received(result: dict[str, Any], consumer: Any) -> dict[str, Any]:
    result["applied"] = consumer.version
    weights = consumer.live if hasattr(consumer, "live") else consumer.weights
    result["checksum"] = checksum(weights)
    return result


# -- a commit that cannot go through --------------------------------------------------------------
def scenario_stuck_request(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 2 serves a request that outlives its commit timeout while version 2 arrives."""
    w.init(rank, world, port)
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(layout, None, 0, direct_min=w.DIRECT_MIN)
        for version in (1, 2, 3):
            out[f"v{version}"] = w.outcome(
                lambda v=version: sender.send(w.make_state(v), v, DEADLINE).version
            )
        out["broken"] = sender.broken
        return out
    live = {k: v.clone() for k, v in w.make_state(0).items()}
    buffer = DoubleBuffer(live, layout, commit_timeout_s=COMMIT_TIMEOUT)
    receiver = BroadcastReceiver(layout, None, 0)
    out["v1"] = _received(w.outcome(lambda: receiver.receive(buffer, DEADLINE).version), buffer)
    release = threading.Event()
    serving = threading.Event()

    def stuck_request() -> None:
        with buffer.serving(DEADLINE):
            serving.set()
            release.wait(DEADLINE)

    request = threading.Thread(target=stuck_request)
    if rank == 2:
        request.start()
        serving.wait(DEADLINE)
    out["v2"] = _received(w.outcome(lambda: receiver.receive(buffer, DEADLINE).version), buffer)
    out["pending_after_v2"] = buffer.pending_version
    release.set()
    if rank == 2:
        request.join(DEADLINE)
    out["v3"] = _received(w.outcome(lambda: receiver.receive(buffer, DEADLINE).version), buffer)
    out["broken"] = receiver.broken
    return out


# -- what the sender must refuse, or send exactly ----------------------------------------------
def tricky_state(version: int) -> dict[str, torch.Tensor]:
    """Views whose bytes are not their values (conjugate, negative bit), at least direct_min large."""
    g = torch.Generator().manual_seed(500 + version)
    sd = dict(w.make_state(version, small=20))
    sd["conj"] = torch.randn(w.DIRECT_MIN // 8 + 5, dtype=torch.complex64, generator=g).conj()
    sd["neg"] = torch.randn(w.DIRECT_MIN // 8 + 7, dtype=torch.complex64, generator=g).conj().imag
    return sd


def resolved(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.resolve_conj().resolve_neg() for k, v in sd.items()}


def scenario_sender_checks(rank: int, world: int, port: int) -> dict[str, Any]:
    """Bad versions refused before anything is sent; conj/neg views bit-exact; a quoted name."""
    w.init(rank, world, port)
    layout = w.layout_of(resolved(tricky_state(0)))
    out: dict[str, Any] = {}
    if rank == 0:
        assert tricky_state(1)["conj"].is_conj()
        assert tricky_state(1)["neg"].is_neg()
        sender = BroadcastSender(layout, None, 0, direct_min=w.DIRECT_MIN)
        for label, bad in (("float", 2.0), ("bool", True), ("huge", 2**63), ("negative", -1)):
            out[label] = w.outcome(lambda b=bad: sender.send(tricky_state(1), b, DEADLINE))
        out["views"] = w.outcome(lambda: sender.send(tricky_state(1), 1, DEADLINE).version)
        out["quoted"] = w.outcome(lambda: sender.send(tricky_state(2), 2, DEADLINE).version)
        out["broken"] = sender.broken
        return out
    receiver = BroadcastReceiver(layout, None, 0)
    consumer = RecordingConsumer(layout, resolved(tricky_state(0)), tensor_targets=rank == 2)
    out["views"] = _received(w.outcome(lambda: receiver.receive(consumer, DEADLINE).version), consumer)
    out["first_call"] = consumer.calls[0]
    if rank == 2:  # this receiver's layout calls a parameter "it's.w": a mismatch names it exactly
        other = {("it's.w" if k == "layers.3.w" else k): v for k, v in resolved(tricky_state(0)).items()}
        theirs = RecordingConsumer(w.layout_of(other))
        out["quoted"] = w.outcome(lambda: receiver.receive(theirs, DEADLINE).version)
    else:
        out["quoted"] = w.outcome(lambda: receiver.receive(consumer, DEADLINE).version)
    out["broken"] = receiver.broken
    return out


# -- one version from two senders ---------------------------------------------------------------
SENDERS = ("a", "b")
#: ranks: 0 = trainer a, 1 = trainer b, 2 and 3 = rollout workers receiving from both
RECEIVERS = (2, 3)


def shares_of(layout: Layout) -> dict[str, list[int]]:
    half = len(layout.buckets) // 2
    return {"a": list(range(half)), "b": list(range(half, len(layout.buckets)))}


def _groups(rank: int, store: Any) -> dict[str, MemberGroup]:
    """Group "a" is (trainer a, receivers), group "b" is (trainer b, receivers): sender first."""
    groups: dict[str, MemberGroup] = {}
    for index, sender in enumerate(SENDERS):
        members = [index, *RECEIVERS]
        if rank in members:
            groups[sender] = MemberGroup.create(store, f"share-{sender}", members.index(rank), 3, 60.0)
    return groups


def scenario_two_senders(rank: int, world: int, port: int) -> dict[str, Any]:
    """v1 both shares; v2 b leaves a bucket out; v3 both again; v4 b is SIGKILLed mid-version."""
    store = member_store(rank)
    layout = w.layout_of(w.make_state(0), bucket=8 * 1024)
    shares = shares_of(layout)
    groups = _groups(rank, store)
    if rank in (0, 1):
        out = _send_share(SENDERS[rank], groups[SENDERS[rank]], layout, shares)
    else:
        out = _receive_shares(groups, layout, shares)
    finish(store, rank, [0, *RECEIVERS])  # trainer b is dead by now
    return out


def _send_share(
    sender: str, group: MemberGroup, layout: Layout, shares: dict[str, list[int]]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tx = BroadcastSender(layout, group, 0, checksums=True, direct_min=w.DIRECT_MIN)
    share = shares[sender]

    def send(sd: Mapping[str, torch.Tensor], version: int, buckets: list[int]) -> dict[str, Any]:
        return w.outcome(lambda: tx.send(sd, version, DEADLINE, buckets=buckets).buckets)

    out["v1"] = send(w.make_state(1), 1, share)
    out["v2"] = send(w.make_state(2), 2, share[:-1] if sender == "b" else share)
    out["v3"] = send(w.make_state(3), 3, share)
    state: Mapping[str, torch.Tensor] = w.make_state(4)
    if sender == "b":  # dies while packing a tensor of its share, mid-version
        victim = layout.buckets[share[len(share) // 2]].tensors[0].name
        state = w.FlakyMapping(state, victim, 1, "kill")
    out["v4"] = send(state, 4, share)
    out["broken"] = tx.broken
    return out


def _receive_shares(
    groups: dict[str, MemberGroup], layout: Layout, shares: dict[str, list[int]]
) -> dict[str, Any]:
    live = {k: v.clone() for k, v in w.make_state(0).items()}
    buffer = DoubleBuffer(live, layout)
    assembly = Assembly(buffer, shares)
    receivers = {s: BroadcastReceiver(layout, groups[s], 0) for s in SENDERS}
    out: dict[str, Any] = {}

    def both(expect: dict[str, list[int]], deadline: float = DEADLINE) -> dict[str, Any]:
        def one(sender: str) -> Callable[[], Any]:
            return lambda: receivers[sender].receive(assembly.part(sender), deadline, buckets=expect[sender])

        with ThreadPoolExecutor(2) as pool:
            futures = {s: pool.submit(w.outcome, one(s)) for s in SENDERS}
            result: dict[str, Any] = {s: f.result() for s, f in futures.items()}
        return _received(result, buffer)

    out["v1"] = both(shares)
    out["v2"] = both({"a": shares["a"], "b": shares["b"][:-1]})  # b's receive expects what b sends
    out["v3"] = both(shares)
    start = time.monotonic()
    out["v4"] = both(shares, deadline=20.0)
    out["v4_seconds"] = time.monotonic() - start
    out["broken"] = {s: receivers[s].broken for s in SENDERS}
    return out


# -- senders that announce different versions -------------------------------------------------
def scenario_mixed_versions(rank: int, world: int, port: int) -> dict[str, Any]:
    """v1 from both senders; then sender a announces 2 while sender b announces 3 (each with its
    share of its own version); then 4 from both. Receivers take each version with a
    `SharesReceiver` (one receive per sender's group, in threads) into a DoubleBuffer."""
    store = member_store(rank)
    layout = w.layout_of(w.make_state(0), bucket=8 * 1024)
    shares = shares_of(layout)
    groups = _groups(rank, store)
    out: dict[str, Any] = {}
    if rank in (0, 1):
        sender = SENDERS[rank]
        tx = BroadcastSender(layout, groups[sender], 0, checksums=True, direct_min=w.DIRECT_MIN)
        for label, version in (("v1", 1), ("mixed", 2 + rank), ("v4", 4)):
            out[label] = w.outcome(
                lambda v=version: tx.send(w.make_state(v), v, DEADLINE, buckets=shares[sender]).version
            )
        out["broken"] = tx.broken
    else:
        buffer = DoubleBuffer({k: v.clone() for k, v in w.make_state(0).items()}, layout)
        parts = [(s, BroadcastReceiver(layout, groups[s], 0), shares[s]) for s in SENDERS]
        for label in ("v1", "mixed", "v4"):
            out[label] = _received(w.outcome(lambda: SharesReceiver(parts).receive(buffer, DEADLINE)), buffer)
        out["broken"] = {s: rx.broken for s, rx, _ in parts}
    finish(store, rank, [0, 1, *RECEIVERS])
    return out
