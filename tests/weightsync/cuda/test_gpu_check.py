"""`benchmarks/gpu_check.py --cpu-dry-run` as a process: its claims hold here, its exit status
follows them, a failed step is a one-line error in the table, and it leaves no temp folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlfleet.weightsync import cleanup_stale_segments

ROOT = Path(__file__).resolve().parents[3]


def _run(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = tmp_path / "gpu.json"
    env = {**os.environ, "TMPDIR": str(scratch)}
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/gpu_check.py",
            "--cpu-dry-run",
            "--gib",
            "0.02",
            "--json",
            str(out),
            *extra,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    claims = json.loads(out.read_text())
    return proc, claims, scratch


@pytest.mark.timeout(300)
def test_cpu_dry_run_holds_its_claims_and_exits_zero(tmp_path: Path) -> None:
    proc, claims, scratch = _run(tmp_path)
    assert all(c["ok"] for c in claims.values()), proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in (
        "cuda_ipc_bit_exact",
        "cuda_ipc_abort_keeps_previous",
        "cuda_ipc_double_buffer_bit_exact",
        "worker_ipc_channel_bit_exact",  # policygroup's same-node path at its endpoint level
        "worker_ipc_channel_failure_keeps_previous",
    ):
        assert claims[name]["value"] == 1, claims[name]
    assert claims["offload_reload_bit_exact"]["value"] == 1
    assert "skipped" in claims["nccl_bucket_loop_ok"]["unit"]  # no NCCL without a GPU
    assert "skipped" in claims["worker_ipc_channel_over_memcpy"]["unit"]  # no device memcpy here
    assert not list(scratch.glob("rlfleet-gpucheck-*")), "temp folders left behind"


@pytest.mark.timeout(300)
def test_a_failed_step_is_a_missed_claim_and_a_non_zero_exit(tmp_path: Path) -> None:
    proc, claims, scratch = _run(tmp_path, "--sync-timeout", "0.001")  # every sync misses its deadline
    for prefix in ("rlfleet-ipc", "rlfleet-ipcslots"):
        cleanup_stale_segments(prefix)  # the children were stopped mid-sync
    missed = {n: c for n, c in claims.items() if not c["ok"]}
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for name in ("cuda_ipc_bit_exact", "worker_ipc_channel_bit_exact"):
        assert name in missed, claims
        value = missed[name]["value"]
        assert value.startswith("ERROR ")
        assert "\n" not in value
        row = next(line for line in proc.stdout.splitlines() if line.startswith(name))
        assert "MISSED" in row, row
    # the IPC step's sender misses its deadline first; in the worker step a reader may first find
    # the channel the writer closed after its own miss: either way a one-line error
    assert "Timeout" in next(line for line in proc.stdout.splitlines() if line.startswith("cuda_ipc_bit"))
    assert "--- traceback" in proc.stderr
    assert claims["offload_reload_bit_exact"]["ok"], "the other steps still ran"
    assert not list(scratch.glob("rlfleet-gpucheck-*")), "temp folders left behind"
