"""One decoder for JSON metadata that comes from a peer.

Every decoder of peer metadata must end in `MetadataError` whatever the bytes: oversized input,
invalid UTF-8, invalid JSON, and JSON nested deeper than the decoder's stack (``b"[" * 50_000``
raises RecursionError inside `json.loads`, which is not a ValueError). Doing that in one place
keeps the copies from drifting apart (one of them once let RecursionError escape).
"""

from __future__ import annotations

import json
from typing import Any

from rlfleet.weightsync._errors import MetadataError

__all__ = ["decode_json"]


def decode_json(raw: bytes | bytearray | str, what: str, limit: int | None = None) -> Any:
    """The JSON value in `raw` (UTF-8 bytes or text); `MetadataError` naming `what` if it is not one.

    `limit` caps the size in bytes (characters for text) before anything is parsed.
    """
    if not isinstance(raw, (bytes, bytearray, str)):
        raise MetadataError(f"{what} must be bytes or text, got {type(raw).__name__}")
    if limit is not None and len(raw) > limit:
        raise MetadataError(f"{what} is {len(raw)} bytes, over the {limit}-byte limit")
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MetadataError(f"{what} is not valid JSON (not UTF-8: {exc})") from None
    try:
        return json.loads(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        raise MetadataError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:  # "[[[[..." nested deeper than the decoder's stack
        raise MetadataError(f"{what} is nested too deeply") from None
