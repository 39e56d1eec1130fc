"""The wire dtype in the layout, delta encodings and FP8 blocks, in one process."""

from __future__ import annotations

import json

import pytest
import torch

from rlfleet.weightsync import (
    ChecksumMismatchError,
    Layout,
    LayoutMismatchError,
    MetadataError,
    RecordingConsumer,
)
from rlfleet.weightsync.codec import (
    SCALE_SUFFIX,
    DeltaEncoder,
    apply_delta,
    bucket_digest,
    dequantize_fp8_blocks,
    encode_delta,
    fp8_error,
    fp8_layout,
    fp8_names,
    quantize_fp8_blocks,
    quantize_state_dict,
    rebuild,
)


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "a.weight": torch.randn(300, 200, generator=g),
        "a.bias": torch.randn(300, generator=g),
        "embed.weight": torch.randn(50, 200, generator=g),
        "steps": torch.tensor([1, 2], dtype=torch.int64),
    }


# -- the wire dtype ------------------------------------------------------------------------------
def test_a_cast_layout_records_both_dtypes_and_matches_the_engines_digest() -> None:
    sd = _trainer()
    wire = Layout.from_state_dict(sd, 4096, wire_dtype=torch.bfloat16)
    assert [(s.dtype, s.source) for s in wire.tensors] == [
        ("bfloat16", "float32"),
        ("bfloat16", "float32"),
        ("bfloat16", "float32"),
        ("int64", None),
    ]
    engine = Layout.from_state_dict(
        {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in sd.items()}, 4096
    )
    assert wire.digest == engine.digest
    assert wire == engine
    assert wire.padded_bytes < 0.52 * Layout.from_state_dict(sd, 4096).padded_bytes
    back = Layout.from_json(wire.to_json())
    assert [s.source for s in back.tensors] == [s.source for s in wire.tensors]
    assert json.loads(wire.to_json())["tensors"][0] == ["a.weight", [300, 200], "bfloat16", "float32"]


def test_an_old_layout_still_loads_with_its_digest() -> None:
    old = {
        "format": 2,
        "bucket_bytes": 4096,
        "alignment": 512,
        "dense_below": 65536,
        "tensors": [["w", [4, 4], "float32"]],
    }
    old["digest"] = Layout([("w", (4, 4), "float32")], 4096).digest
    assert Layout.from_dict(old).tensors[0].source is None


def test_sender_checks_take_the_source_dtype_receivers_only_the_wire_dtype() -> None:
    sd = _trainer()
    wire = Layout.from_state_dict(sd, 4096, wire_dtype="bfloat16")
    wire.check_state_dict(sd, sending=True)
    with pytest.raises(LayoutMismatchError, match=r"a\.weight"):
        wire.check_state_dict(sd)  # a receiver holding fp32 does not hold what travels
    with pytest.raises(LayoutMismatchError, match=r"float16.*bfloat16 \(from float32\)"):
        wire.check_state_dict({**sd, "a.weight": sd["a.weight"].half()}, sending=True)


@pytest.mark.parametrize(
    ("wire_dtype", "error"),
    [
        ("int8", ValueError),
        (torch.int32, ValueError),
        (3, TypeError),
        ({"nope": torch.bfloat16}, ValueError),
        ({"steps": torch.bfloat16}, ValueError),
        ("bfloat17", MetadataError),
    ],
)
def test_a_bad_wire_dtype_is_a_clear_error(wire_dtype: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        Layout.from_state_dict(_trainer(), 4096, wire_dtype=wire_dtype)  # type: ignore[arg-type]


def test_a_peer_layout_may_not_cast_between_kinds() -> None:
    with pytest.raises(MetadataError, match="only between floating"):
        Layout([("w", (2,), "bfloat16", "int64")])


def test_packing_casts_once_and_adopt_refuses_a_cast_layout() -> None:
    from rlfleet.weightsync import SharedBuffer, SharedBufferReader, adopt

    sd = _trainer()
    wire = Layout.from_state_dict(sd, 1 << 20, wire_dtype=torch.bfloat16)
    with SharedBuffer(wire, num_readers=1) as shared, SharedBufferReader.attach(shared.name) as reader:
        shared.publish(sd, version=1)
        reader.wait_for_version(1, 10.0)
        got = {k: v.clone() for k, v in reader.tensors().items()}
    for name, tensor in sd.items():
        want = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
        assert torch.equal(got[name], want), name
    with pytest.raises(ValueError, match="casts tensors"):
        adopt(sd, wire)


# -- deltas ------------------------------------------------------------------------------------
def _bf16_bucket(n: int, seed: int) -> torch.Tensor:
    return (
        (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.02)
        .to(torch.bfloat16)
        .view(torch.uint8)
    )


@pytest.mark.parametrize(("fraction", "kind"), [(0.002, "sparse"), (0.2, "bitmap"), (0.6, "full")])
def test_delta_round_trip_is_bit_exact_and_picks_the_smaller_encoding(fraction: float, kind: str) -> None:
    base = _bf16_bucket(1 << 16, 1)
    current = base.clone()
    words = current.view(torch.int16)
    picked = torch.randperm(words.numel(), generator=torch.Generator().manual_seed(2))[
        : int(fraction * words.numel())
    ]
    words[picked] += 1
    payload = encode_delta(current, base.clone(), 0.5)
    assert payload.kind == kind
    assert payload.changed == picked.numel()
    out = base.clone()
    if kind != "full":
        apply_delta(payload.kind, payload.data, out)
        assert payload.nbytes < 0.5 * current.numel()
    else:
        out.copy_(payload.data)
    assert torch.equal(out, current)
    assert bucket_digest(out) == payload.digest


def test_encoding_with_update_makes_the_base_the_new_bucket() -> None:
    base, current = _bf16_bucket(4096, 1), _bf16_bucket(4096, 2)
    kept = base.clone()
    encode_delta(current, kept, 1.0, update=True)
    assert torch.equal(kept, current)


def test_a_malformed_delta_is_a_metadata_error_and_writes_nothing() -> None:
    base = _bf16_bucket(4096, 1)
    current = base.clone()
    current.view(torch.int16)[7] += 1
    payload = encode_delta(current, base.clone())
    out = base.clone()
    with pytest.raises(MetadataError):
        apply_delta("sparse", payload.data[:-2], out)
    bad = payload.data.clone()
    bad[16:20].view(torch.int32)[0] = 10**6  # an index past the bucket
    with pytest.raises(MetadataError, match="outside"):
        apply_delta("sparse", bad, out)
    with pytest.raises(MetadataError, match="unknown delta kind"):
        apply_delta("zstd", payload.data, out)
    assert torch.equal(out, base)


def test_a_delta_for_the_wrong_base_is_refused_by_digest() -> None:
    layout = Layout([("w", (2048,), "bfloat16")], 8192)
    v1 = {"w": (torch.randn(2048) * 0.02).to(torch.bfloat16)}
    v2 = {"w": v1["w"].clone()}
    v2["w"][::50] += 0.01
    encoder = DeltaEncoder(layout)
    from rlfleet.weightsync import pack_all

    encoder.start(1, False)
    encoder.encode(0, pack_all(layout, v1), False)
    encoder.finish(1, True)
    assert encoder.base_version == 1
    assert encoder.base_bytes == layout.padded_bytes
    encoder.start(2, True)
    payload = encoder.encode(0, pack_all(layout, v2), True)
    assert payload.kind == "sparse"
    assert encoder.last.changed_fraction < 0.1
    other = {"w": v1["w"].clone()}
    other["w"][3] += 1.0  # a receiver whose base is not the sender's
    receiver = RecordingConsumer(layout, other)
    out = torch.empty(layout.buckets[0].nbytes, dtype=torch.uint8)
    with pytest.raises(ChecksumMismatchError, match="digest"):
        rebuild(receiver, 0, payload.kind, payload.data, out, payload.digest)
    good = RecordingConsumer(layout, v1)
    rebuild(good, 0, payload.kind, payload.data, out, payload.digest)
    assert torch.equal(out, pack_all(layout, v2))
    encoder.finish(2, False)  # a failed version: the base is forgotten, the next one goes full
    assert encoder.offer() is None


def test_delta_mode_and_fraction_are_checked() -> None:
    layout = Layout([("w", (4,), "float32")])
    with pytest.raises(ValueError, match="delta must be one of"):
        DeltaEncoder(layout, "on")
    with pytest.raises(ValueError, match="max_fraction"):
        DeltaEncoder(layout, "auto", 0.0)


# -- FP8 ---------------------------------------------------------------------------------------
def test_fp8_blocks_round_trip_their_scales_and_are_reproducible() -> None:
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(5)) * 0.05
    w[:128, :128] *= 100  # one block of large values: its own scale
    q, scale_inv = quantize_fp8_blocks(w)
    assert q.dtype == torch.float8_e4m3fn
    assert q.shape == w.shape
    assert scale_inv.shape == (3, 2)
    q2, s2 = quantize_fp8_blocks(w.clone())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8))
    assert torch.equal(scale_inv, s2)
    assert scale_inv[0, 0] > 50 * scale_inv[1, 1]
    back = dequantize_fp8_blocks(q, scale_inv)
    assert float(((back - w).abs() / w.abs().amax()).max()) < 0.07
    assert 0 < fp8_error(w) <= 2**-4 + 1e-6  # e4m3 keeps 3 mantissa bits
    with pytest.raises(ValueError, match="2-D floating"):
        quantize_fp8_blocks(torch.zeros(3, dtype=torch.int32))


def test_fp8_layout_and_state_dict_agree_and_keep_other_casts() -> None:
    sd = _trainer()
    assert fp8_names(sd) == ["a.weight"]
    layout = fp8_layout(Layout.from_state_dict(sd, 1 << 20, wire_dtype=torch.bfloat16))
    assert [(s.name, s.dtype) for s in layout.tensors][:3] == [
        ("a.weight", "float8_e4m3fn"),
        ("a.weight" + SCALE_SUFFIX, "float32"),
        ("a.bias", "bfloat16"),
    ]
    sent = quantize_state_dict(sd)
    layout.check_state_dict(sent, sending=True)
    assert layout["a.weight"].nbytes == 300 * 200  # one byte an element, half of bf16
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert fp8_names(model) == ["0.weight", "1.weight"]
    with pytest.raises(ValueError, match="2-D floating"):
        fp8_layout(layout.cast(None), ["a.bias"])
