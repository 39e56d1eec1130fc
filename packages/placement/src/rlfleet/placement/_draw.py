"""What every picture of the package shares: units a reader can read and DOT quoting."""

from __future__ import annotations

__all__ = ["human_bytes", "quote_dot"]


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.3g} {unit}"
        nbytes /= 1000
    return f"{nbytes:.3g} TB"  # pragma: no cover


def quote_dot(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
