"""The main job runs end to end: rollouts through the group, training, syncs, verification."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "examples" / "cartpole_rl.py"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["Shared", "Double"])
def test_short_demo_runs_versions_advance_and_weights_agree(tmp_path: Path, strategy: str) -> None:
    iterations = 3
    proc = subprocess.run(
        [
            sys.executable,
            str(DEMO),
            "--iterations",
            str(iterations),
            "--verify-every",
            "1",
            "--no-progress",
            "--no-require-solved",
            "--strategy",
            strategy,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=380,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # one initial sync plus one per iteration; every eval policy serves the last one
    match = re.search(r"weight version (\d+);\s+eval versions\s+\[([\d,\s]+)\]", proc.stdout)
    assert match, proc.stdout[-2000:]
    assert int(match.group(1)) == iterations + 1
    assert {int(v) for v in match.group(2).split(",")} == {iterations + 1}
    assert (tmp_path / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plan that ran, drawn with what the last sync measured; one summary line per sync
    assert (tmp_path / "sync_plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summaries = re.findall(r"sync v(\d+) ok .* s measured / .* s predicted", proc.stdout)
    assert [int(v) for v in summaries] == list(range(1, iterations + 2)), proc.stdout[-2000:]
