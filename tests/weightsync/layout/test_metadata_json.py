"""The one decoder of peer JSON metadata: every failure is a MetadataError naming what it was."""

from __future__ import annotations

import pytest

from rlfleet.weightsync import Layout, MetadataError
from rlfleet.weightsync.cuda._cuda_ipc import _decode_meta
from rlfleet.weightsync.cuda._nccl import decode_unique_id
from rlfleet.weightsync.layout._json import decode_json
from rlfleet.weightsync.reshard._reshard import RankProgram, _decode_header


def test_decodes_bytes_and_text() -> None:
    assert decode_json(b'{"a": [1, 2]}', "thing") == {"a": [1, 2]}
    assert decode_json('{"a": "\u00e9"}', "thing") == {"a": "\u00e9"}
    assert decode_json(bytearray(b"[1]"), "thing", limit=3) == [1]


@pytest.mark.parametrize(
    ("raw", "limit", "words"),
    [
        (b"[" * 50_000, None, "nested too deeply"),
        (b'{"a":' * 50_000, None, "nested too deeply"),
        (b"\xff\xfe{}", None, "not valid JSON"),
        (b"{", None, "not valid JSON"),
        ("", None, "not valid JSON"),
        (b"[1]" + b" " * 100, 100, "over the 100-byte limit"),
    ],
)
def test_failures_are_metadata_errors_naming_what(raw: bytes | str, limit: int | None, words: str) -> None:
    with pytest.raises(MetadataError, match=f"peer blob.*{words}"):
        decode_json(raw, "peer blob", limit)


@pytest.mark.parametrize("raw", [b"[" * 50_000, b"\xff", b"{", b"null"])
def test_every_metadata_decoder_ends_in_metadata_error(raw: bytes) -> None:
    for decode in (Layout.from_json, decode_unique_id, _decode_meta, RankProgram.coerce, _decode_header):
        with pytest.raises(MetadataError):
            decode(raw)  # type: ignore[operator]


def test_size_limits_are_kept() -> None:
    with pytest.raises(MetadataError, match=r"layout metadata.*limit"):
        Layout.from_json(b" " * 20, max_bytes=10)
