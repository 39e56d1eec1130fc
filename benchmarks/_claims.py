"""The one claim/report helper every benchmark script uses.

A claim is ``{"value": v, "target": t, "unit": u, "ok": bool}``; a script collects its claims in a
dict, prints them as a table and writes them as JSON (``--json PATH``), and exits non-zero when a
claim with a target is missed. Scripts import this module as ``_claims`` (run as
``python benchmarks/<name>.py``, this directory is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import math
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Claim = dict[str, Any]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, for a benchmark's rendezvous store."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def claim(value: float, target: float | None, unit: str, *, higher_is_better: bool = True) -> Claim:
    """One claim; ``target=None`` means "report" (always ok, printed as measured)."""
    if isinstance(value, float) and math.isfinite(value):
        value = round(value, 4)
    if target is None:
        ok = True
    elif not isinstance(value, (int, float)) or (isinstance(value, float) and math.isnan(value)):
        ok = False
    else:
        ok = value >= target if higher_is_better else value <= target
    if not higher_is_better and target is not None and not unit.endswith("(<= target)"):
        unit = f"{unit} (<= target)"
    return {"value": value, "target": target, "unit": unit, "ok": bool(ok)}


def arguments(description: str) -> argparse.ArgumentParser:
    """The parser every script starts from: ``--quick`` (CI-sized) and ``--json PATH``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="CI-sized run (seconds, not minutes)")
    parser.add_argument("--json", metavar="PATH", help="write the claims as JSON to PATH")
    return parser


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e5 else f"{value:,.0f}"
    return str(value)


def report(claims: Mapping[str, Claim], json_path: str | None, *, title: str = "") -> int:
    """Print the claims as a table, write them to ``json_path``; 0 when every claim is ok, else 1."""
    if title:
        print(f"\n{title}")
    width = max((len(name) for name in claims), default=5)
    print(f"\n{'claim':<{width}}  {'value':>14}  {'target':>10}  unit  ok")
    for name, c in claims.items():
        mark = "ok" if c["ok"] else "MISSED"
        target = "report" if c["target"] is None else _fmt(c["target"])
        print(f"{name:<{width}}  {_fmt(c['value']):>14}  {target:>10}  {c['unit']}  {mark}")
    if json_path:
        Path(json_path).write_text(json.dumps(dict(claims), indent=2))
    return 0 if all(c["ok"] for c in claims.values()) else 1
