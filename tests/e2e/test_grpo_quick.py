"""The GRPO example end to end: FSDP2 trainer, rollouts through the group, syncs, verification."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
from pathlib import Path

import pytest

GRPO = Path(__file__).resolve().parents[2] / "examples" / "grpo_tiny_lm.py"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GRPO), "--no-progress", "--out", str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=560,
    )


@pytest.mark.timeout(600)
def test_grpo_quick_runs_the_pipeline_and_writes_the_curve(tmp_path: Path) -> None:
    proc = run(tmp_path, "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipeline ok" in proc.stdout
    # one initial sync plus one per iteration, each verified bit-exact by the script
    match = re.search(r"(\d+) iterations, (\d+) versions synced", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert (int(match.group(1)), int(match.group(2))) == (3, 4)
    with (tmp_path / "reward_curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["version"]) for r in rows] == [2, 3, 4]
    assert all(0.0 <= float(r["mean_reward"]) <= 1.0 for r in rows)
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(600)
def test_grpo_exits_non_zero_when_the_budget_ends_first(tmp_path: Path) -> None:
    proc = run(tmp_path, "--iterations", "1")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "target not reached" in proc.stderr


@pytest.mark.timeout(600)
def test_grpo_async_quick_trains_while_generating_and_prints_the_versions_behind(tmp_path: Path) -> None:
    """`--async`: batch k+1 generates while the trainers train on batch k (max_staleness=1), each
    update swapped in by a background sync; every batch's samples are at most one version
    behind the trainers, printed per batch; the final weights are still verified bit-exact."""
    proc = run(tmp_path, "--quick", "--async")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "pipeline ok" in proc.stdout
    behind = re.findall(
        r"batch +(\d+): reward .*\| versions behind \[([\d, ]+)\] \| trained v(\d+)", proc.stdout
    )
    assert [(int(b), lag, int(v)) for b, lag, v in behind] == [(1, "0", 2), (2, "1", 3), (3, "1", 4)]
    with (tmp_path / "reward_curve.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [(int(r["version"]), float(r["behind"])) for r in rows] == [(2, 0.0), (3, 1.0), (4, 1.0)]
