"""The single-package recipes in examples/recipes run and report success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parents[2] / "examples" / "recipes"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("script", "expect"),
    [
        ("weightsync_two_processes.py", "weights identical to the trainer's: True"),
        ("weightsync_delta_bf16.py", "bf16 weights identical to the trainer's: True"),
        ("routing_async_server.py", "in flight at the end: 0"),
        ("placement_draw_plan.py", "wrote"),
    ],
)
def test_recipe_runs(script: str, expect: str, tmp_path: Path) -> None:
    args = [str(tmp_path / "plan.png")] if script.startswith("placement") else []
    proc = subprocess.run(
        [sys.executable, str(RECIPES / script), *args], capture_output=True, text=True, timeout=280
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert expect in proc.stdout
