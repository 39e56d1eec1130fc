"""Process bodies for the refit stand-down test: one trainer, one generation worker, real gloo.

Both take part in `nccl_reshard_refit` of version 1; then the trainer stalls (alive, silent)
while the generation worker runs the refit of version 2 with ``refit_timeout_s=5``, and exits
10 s after that refit began. With ``stand_down`` a thread of the generation worker calls
`stand_down_refit_watchdog()` 2 s into the refit.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.multiprocessing as mp
from pg_policies import Tiny
from refit_procs import collect, report
from testkit import free_port

from rlfleet.policygroup import BasePolicy, PolicyConfig

TRAIN = {"tp": 1, "pp": 1}
GEN = {"tp": 1}
REFIT_TIMEOUT_S = 5.0
STAND_DOWN_AT_S = 2.0
PEER_EXITS_AT_S = 10.0


def version_weights(policy: BasePolicy, version: int) -> None:
    g = torch.Generator().manual_seed(1000 + version)
    with torch.no_grad():
        for t in policy.model.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g))


def _stand_down_later(policy: BasePolicy, t0: float, done: threading.Event, out: dict[str, Any]) -> None:
    time.sleep(max(0.0, t0 + STAND_DOWN_AT_S - time.monotonic()))
    start = time.monotonic()
    out["stood_down"] = policy.stand_down_refit_watchdog()
    out["stand_down_s"] = time.monotonic() - start
    out["refit_running_after_stand_down"] = not done.is_set()
    time.sleep(max(0.0, t0 + REFIT_TIMEOUT_S + 1.0 - time.monotonic()))
    out["refit_running_past_deadline"] = not done.is_set()


def _generation(policy: BasePolicy, stand_down: bool, events: dict[str, Any], out: dict[str, Any]) -> None:
    policy.nccl_reshard_refit()
    out["v1_version"] = policy.get_weight_version()
    expected = Tiny(role="eval", index=9, device="cpu")
    version_weights(expected, 1)
    out["v1_exact"] = policy.get_weight_checksum() == expected.get_weight_checksum()
    done = threading.Event()
    t0 = time.monotonic()
    events["refit_started"].set()
    if stand_down:
        threading.Thread(target=_stand_down_later, args=(policy, t0, done, out), daemon=True).start()
    try:
        policy.nccl_reshard_refit(refit_timeout_s=REFIT_TIMEOUT_S)
        out["v2"] = {"ok": True}
    except Exception as exc:
        out["v2"] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    done.set()
    out["v2_seconds"] = time.monotonic() - t0
    out["peer_had_exited"] = events["peer_exiting"].is_set()
    out["version_after"] = policy.get_weight_version()
    out["intact"] = policy.get_weight_checksum() == expected.get_weight_checksum()
    watch = policy._reshard_state().watch
    out["fired"], out["watch_stood_down"] = watch.fired, watch.stood_down
    out["state"] = policy._refit_transport_state("nccl_reshard")
    if stand_down:
        time.sleep(max(0.0, t0 + REFIT_TIMEOUT_S + 1.5 - time.monotonic()))  # let the sampler finish


def _body(role: str, stand_down: bool, port: int, events: dict[str, Any], queue: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    policy = Tiny(PolicyConfig(group_timeout_s=60.0), role=role, index=0, device="cpu")
    train = role == "train"
    stage, member = (0, 0) if train else (-1, 1)
    policy.init_nccl_reshard_comm_group(["127.0.0.1"], [port], 1, stage, 2, member)
    policy.prepare_nccl_reshard_refit_info(TRAIN, GEN, 1, 1)
    if not train:
        _generation(policy, stand_down, events, out)
        return out
    version_weights(policy, 1)
    policy.nccl_reshard_refit()
    out["v1_version"] = policy.get_weight_version()
    if not events["refit_started"].wait(120):
        raise TimeoutError("the generation worker never started its refit")
    time.sleep(PEER_EXITS_AT_S)  # stalled: alive and silent
    events["peer_exiting"].set()
    return out  # then the process exits: its sockets close, which ends the generation worker's wait


def worker(role: str, stand_down: bool, port: int, events: dict[str, Any], queue: Any) -> None:
    report(queue, (role, stand_down), lambda: _body(role, stand_down, port, events, queue))


def run(timeout: float = 200.0) -> dict[tuple[str, bool], dict[str, Any]]:
    """Both scenarios side by side: (role, stand_down) -> what that process saw."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs, kept = [], []  # the events must outlive the children's start (start() drops its args)
    for stand_down in (True, False):
        events = {"refit_started": ctx.Event(), "peer_exiting": ctx.Event()}
        kept.append(events)
        port = free_port()
        for role in ("train", "eval"):
            args = (role, stand_down, port, events, queue)
            procs.append(ctx.Process(target=worker, args=args, daemon=True))
    return collect(procs, queue, len(procs), timeout)
