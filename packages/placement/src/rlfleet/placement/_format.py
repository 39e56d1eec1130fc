"""Numbers and names as a reader reads them, for pictures, titles and descriptions: bytes and
rates in decimal units ("50 GB/s", not ``5e+10 B/s``), times in ms or s, DOT strings quoted, and a
name said once ("trainer-0", not "trainer trainer-0")."""

from __future__ import annotations

__all__ = ["human_bytes", "human_rate", "human_seconds", "named", "quote_dot"]

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_bytes(nbytes: float) -> str:
    """``2.15e9`` -> ``"2.15 GB"`` (decimal units, three significant digits)."""
    for unit in _UNITS:
        if abs(nbytes) < 1000 or unit == _UNITS[-1]:
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    raise AssertionError("unreachable")  # pragma: no cover


def human_rate(bytes_per_s: float) -> str:
    """``5e10`` -> ``"50 GB/s"``."""
    return f"{human_bytes(bytes_per_s)}/s"


def human_seconds(seconds: float) -> str:
    """``0.0267`` -> ``"26.7 ms"``; a second or more in seconds."""
    if abs(seconds) < 1e-3:
        return f"{seconds * 1e6:.3g} us"
    return f"{seconds * 1e3:.3g} ms" if abs(seconds) < 1 else f"{seconds:.3g} s"


def named(kind: str, name: str) -> str:
    """``kind name``, unless the name already says its kind (``node0``, ``trainer-0``)."""
    return name if kind.lower() in name.lower() else f"{kind} {name}"


def quote_dot(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
