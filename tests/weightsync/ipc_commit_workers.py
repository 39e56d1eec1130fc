"""Process bodies for the CUDA IPC channel's two-phase commit and slot lifetime tests (spawned,
under `weightsync_dist_workers.run_ranks`), over host slots (``backend="host"``: the same state
machine as on a GPU, over shared memory)."""

from __future__ import annotations

import threading
from typing import Any

import weightsync_dist_workers as w

from rlfleet.weightsync import CudaIpcReceiver, CudaIpcSender, DoubleBuffer, checksum

COMMIT_TIMEOUT = 1.0


def scenario_ipc_commit_fails(rank: int, world: int, port: int, path: str) -> dict[str, Any]:
    """Versions 1-3 to two readers, each a DoubleBuffer; during version 2 a request on reader 2
    outlives its commit timeout, so reader 2 cannot commit: no reader may apply version 2, and
    the sender must not report it."""
    layout = w.layout_of(w.make_state(0))
    out: dict[str, Any] = {}
    if rank == 0:
        with CudaIpcSender(layout, world - 1, backend="host") as sender:
            w._publish_name(path, sender.name)
            for version in (1, 2, 3):
                out[f"v{version}"] = w.outcome(lambda v=version: sender.send(w.make_state(v), v, w.DEADLINE))
        return out
    buffer = DoubleBuffer(
        {k: v.clone() for k, v in w.make_state(0).items()}, layout, commit_timeout_s=COMMIT_TIMEOUT
    )
    with CudaIpcReceiver.attach(w._read_name(path), rank - 1) as receiver:
        for version in (1, 2, 3):
            release, serving = threading.Event(), threading.Event()

            def stuck_request(release: threading.Event = release, serving: threading.Event = serving) -> None:
                with buffer.serving(w.DEADLINE):
                    serving.set()
                    release.wait(w.DEADLINE)

            request = threading.Thread(target=stuck_request)
            if version == 2 and rank == 2:
                request.start()
                serving.wait(w.DEADLINE)
            got = w.outcome(lambda: receiver.receive(buffer, w.DEADLINE))
            release.set()
            if request.is_alive():
                request.join(w.DEADLINE)
            got["applied"], got["checksum"] = buffer.version, checksum(buffer.live)
            got["pending"] = buffer.pending_version
            out[f"v{version}"] = got
    return out
