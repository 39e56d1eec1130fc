"""Collect every benchmark's --json claims into one Markdown table (for the README).

    hatch run python benchmarks/_report.py bench-results/*.json

Each input is `{claim: {"value", "target", "unit", "ok"}}`, as every script here writes.
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def main(paths: list[str]) -> int:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass

    print(f"Machine: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, no GPU.\n")
    print("| benchmark | claim | value | target | unit | ok |")
    print("|---|---|---|---|---|---|")
    failed = 0
    for path in sorted(paths):
        claims = json.loads(Path(path).read_text())
        for name, c in claims.items():
            ok = c.get("ok")
            failed += ok is False
            mark = "yes" if ok else ("skipped" if ok is None else "**no**")
            target = "report" if c.get("target") is None else _fmt(c.get("target"))  # no target: reported
            print(
                f"| {Path(path).stem} | `{name}` | {_fmt(c.get('value'))} | {target} "
                f"| {c.get('unit', '')} | {mark} |"
            )
    return 1 if failed and "--strict" in sys.argv else 0


if __name__ == "__main__":
    sys.exit(main([a for a in sys.argv[1:] if not a.startswith("--")]))
