"""Process bodies for the watched-wire tests (run under `weightsync_dist_workers.run_ranks`)."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import weightsync_dist_workers as w
from member_workers import finish, member_store

from rlfleet.weightsync import (
    BroadcastReceiver,
    Deadline,
    DirectBuffer,
    MemberGroup,
    SyncWatch,
    WatchedBroadcastReceiver,
    WatchedBroadcastSender,
    WatchedDeadline,
    WatchedP2PWire,
    checksum,
    stand_down_armed_watchdogs,
)

PEER_EXITS_AFTER_S = 3.0


def scenario_broadcast(rank: int, world: int, port: int) -> dict[str, Any]:
    """Rank 0 sends through a watched wire; rank 1 receives with the plain BroadcastReceiver,
    rank 2 with a watched one: one protocol, whichever side is watched."""
    store = member_store(rank)
    group = MemberGroup.create(store, "watched", rank, world, 30.0)
    watch = SyncWatch(f"rank {rank}")
    layout = w.layout_of(w.make_state(1))
    out: dict[str, Any] = {}
    end: Any
    if rank == 0:
        end = WatchedBroadcastSender(layout, group, 0, watch)
    elif rank == 1:
        end = BroadcastReceiver(layout, group, 0)
    else:
        end = WatchedBroadcastReceiver(layout, group, 0, watch)
    live = {k: torch.zeros_like(v.contiguous()) for k, v in w.make_state(0).items()}
    buffer = DirectBuffer(live, layout)
    for version in (1, 2):
        state = w.make_state(version)
        with watch.guard(30.0, f"version {version}") as deadline:
            if rank == 0:
                end.send(state, version, deadline)
            else:
                end.receive(buffer, deadline)
        out[f"v{version}"] = rank == 0 or checksum(live) == checksum(state)
    out["fired"], out["stood_down"] = watch.fired, watch.stood_down
    finish(store, rank, range(world))
    return out


def _stand_down_at(seconds: float, out: dict[str, Any]) -> None:
    time.sleep(seconds)  # the controller's call comes this late into the stall (the scenario's timing)
    out["stood_down_count"] = stand_down_armed_watchdogs()


def scenario_stall(rank: int, world: int, port: int, mode: str) -> dict[str, Any]:
    """Rank 0 is alive and silent, then exits; rank 1 waits on a receive from it.

    mode "guard": a 1 s watchdog; "stand_down": the same, stood down at 0.3 s; "deadline": no
    watchdog, the wait bounded by a plain 1 s deadline.
    """
    store = member_store(rank)
    group = MemberGroup.create(store, "stall", rank, world, 30.0)
    if rank == 0:
        store.wait(["stall/started"])
        time.sleep(PEER_EXITS_AFTER_S)
        return {}  # the harness exits the process at once: its sockets close
    watch = SyncWatch("stall")
    wire = WatchedP2PWire(group, watch)
    out: dict[str, Any] = {"timeout_after_lift": str(group.process_group.options._timeout)}
    buf = torch.zeros(16)
    store.set("stall/started", "1")
    start = time.monotonic()
    guarded: list[WatchedDeadline] = []
    try:
        if mode == "deadline":
            wire.recv(buf, 0, 7).wait(Deadline(1.0), "stalled receive")
        else:
            if mode == "stand_down":
                threading.Thread(target=_stand_down_at, args=(0.3, out), daemon=True).start()
            with watch.guard(1.0, "stalled receive") as deadline:
                guarded.append(deadline)
                wire.recv(buf, 0, 7).wait(deadline, "stalled receive")
        out["error"] = None
    except Exception as exc:
        out["error"], out["message"] = type(exc).__name__, str(exc)
    out["lifted"] = any(d.lifted for d in guarded)
    out["seconds"] = time.monotonic() - start
    out["fired"], out["stood_down"] = watch.fired, watch.stood_down
    return out
