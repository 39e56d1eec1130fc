"""Layout, packing and integrity: bit-exact round trips for every dtype; hostile metadata rejected."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from shm_workers import layout_of, make_state, random_tensor, zeros_like_layout

from rlfleet.weightsync import (
    ALIGNMENT,
    DTYPES,
    Layout,
    LayoutMismatchError,
    MetadataError,
    bucket_checksum,
    bucket_starts,
    bucket_views,
    checksum,
    compare_fingerprints,
    fingerprint,
    flat_views,
    pack_all,
    pack_bucket,
    unpack_bucket_into,
)
from rlfleet.weightsync.layout._layout import DENSE_BELOW


def test_offsets_are_aligned_and_buckets_capped() -> None:
    sd = make_state(1)
    layout = layout_of(sd, 64 * 1024)
    for spec in layout.tensors:
        assert spec.offset % spec.torch_dtype.itemsize == 0  # every typed view needs this
        if spec.nbytes >= DENSE_BELOW:
            assert spec.offset % ALIGNMENT == 0  # large tensors: where alignment matters
    for bucket in layout.buckets:
        assert bucket.nbytes % ALIGNMENT == 0
        if len(bucket.tensors) > 1:
            assert bucket.nbytes <= layout.bucket_bytes
    big = layout["embed.weight"]
    assert big.nbytes > layout.bucket_bytes
    assert layout.buckets[big.bucket].tensors == (big,), "an oversized tensor travels alone"
    assert layout.total_bytes == sum(t.numel() * t.element_size() for t in sd.values())
    assert sum(b.nbytes for b in layout.buckets) == layout.padded_bytes


@pytest.mark.parametrize("bucket_bytes", [ALIGNMENT, 4096, 64 * 1024, 1 << 30])
def test_pack_unpack_round_trip_every_dtype(bucket_bytes: int) -> None:
    sd = make_state(2)
    assert {t.dtype for t in sd.values()} >= set(DTYPES.values())
    layout = layout_of(sd, bucket_bytes)
    out = zeros_like_layout(layout)
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    for bucket in layout.buckets:
        data = pack_bucket(layout, bucket.index, sd, scratch)
        assert data.numel() == bucket.nbytes
        unpack_bucket_into(layout, bucket.index, data, out)
    assert checksum(out) == checksum(sd)
    flat = pack_all(layout, sd)
    views = flat_views(layout, flat)
    assert list(views) == list(layout.names)
    assert checksum(views) == checksum(sd)


def test_views_share_memory_with_the_buffer() -> None:
    sd = make_state(3)
    layout = layout_of(sd)
    flat = pack_all(layout, sd)
    start = bucket_starts(layout)[0]
    views = bucket_views(layout, 0, flat[start:])
    name, view = next((n, v) for n, v in views.items() if v.numel())
    lo, hi = flat.data_ptr(), flat.data_ptr() + flat.numel()
    assert lo <= view.data_ptr() < hi
    before = bucket_checksum(flat)
    flat[layout[name].offset] ^= 0xFF
    assert bucket_checksum(flat) != before


def test_pack_rejects_wrong_state_dicts_naming_the_parameter() -> None:
    sd = make_state(1)
    layout = layout_of(sd)
    scratch = torch.empty(layout.max_bucket_nbytes, dtype=torch.uint8)
    bad = dict(sd)
    del bad["step"]
    with pytest.raises(LayoutMismatchError, match="'step'") as info:
        pack_bucket(layout, layout["step"].bucket, bad, scratch)
    assert info.value.parameter == "step"
    bad = dict(sd, transposed=torch.zeros(2, 2))
    with pytest.raises(LayoutMismatchError, match="'transposed'"):
        layout.check_state_dict(bad)
    with pytest.raises(LayoutMismatchError, match="'extra'"):
        layout.check_state_dict(dict(sd, extra=torch.zeros(1)))
    with pytest.raises(ValueError, match="bytes"):
        pack_bucket(layout, 0, sd, torch.empty(1, dtype=torch.uint8))
    with pytest.raises(MetadataError, match="bucket 999"):
        pack_bucket(layout, 999, sd, scratch)


def test_json_round_trip_digest_and_diff() -> None:
    sd = make_state(1)
    layout = layout_of(sd)
    again = Layout.from_json(layout.to_json())
    assert again == layout
    assert again.digest == layout.digest
    assert [(t.name, t.offset, t.bucket) for t in again.tensors] == [
        (t.name, t.offset, t.bucket) for t in layout.tensors
    ]
    other = layout_of(dict(sd, transposed=torch.zeros(2, 2)))
    assert other.digest != layout.digest
    assert "'transposed'" in (layout.diff(other) or "")
    with pytest.raises(LayoutMismatchError) as info:
        layout.require_same(other)
    assert info.value.parameter == "transposed"


def test_fingerprint_and_checksum() -> None:
    sd = make_state(1)
    g = torch.Generator().manual_seed(0)
    floats = {f"w{i}": torch.randn(10 + i, generator=g).to(torch.bfloat16) for i in range(5)}
    floats["transposed"] = torch.randn(8, 4, generator=g).t()
    ref = fingerprint(floats)
    assert compare_fingerprints(ref, fingerprint(floats)) == []
    changed = dict(floats, transposed=floats["transposed"] * 2 + 1)
    assert any("transposed" in p for p in compare_fingerprints(ref, fingerprint(changed)))
    assert checksum(sd) == checksum(dict(reversed(list(sd.items()))))
    flipped = dict(sd, step=sd["step"] + 1)
    assert checksum(flipped) != checksum(sd)


def test_checksum_leaves_storages_resizable() -> None:
    tensor = torch.randn(100)
    checksum({"t": tensor})
    bucket_checksum(tensor.view(torch.uint8))
    assert tensor.untyped_storage().resizable()


# -- hypothesis: random layouts round-trip --------------------------------------------------------
_dtype_names = sorted(DTYPES)
_entries = st.lists(
    st.tuples(
        st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple),
        st.sampled_from(_dtype_names),
        st.booleans(),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    entries=_entries,
    bucket_bytes=st.sampled_from([ALIGNMENT, 1024, 4096, 1 << 20]),
    seed=st.integers(0, 2**31),
)
def test_random_layouts_round_trip(
    entries: list[tuple[tuple[int, ...], str, bool]], bucket_bytes: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for i, (shape, dtype_name, transpose) in enumerate(entries):
        tensor = random_tensor(shape, DTYPES[dtype_name], g)
        if transpose and tensor.dim() >= 2:
            tensor = tensor.transpose(0, -1)
        sd[f"p{i}"] = tensor
    layout = Layout.from_state_dict(sd, bucket_bytes)
    assert Layout.from_json(layout.to_json()) == layout
    flat = pack_all(layout, sd)
    assert checksum(flat_views(layout, flat)) == checksum(sd)
    out = zeros_like_layout(layout)
    for bucket, start in zip(layout.buckets, bucket_starts(layout), strict=True):
        unpack_bucket_into(layout, bucket.index, flat[start : start + bucket.nbytes], out)
    assert checksum(out) == checksum(sd)


# -- hypothesis: hostile metadata is a MetadataError, never anything else ---------------------
_json_values: st.SearchStrategy[Any] = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5)
    ),
    max_leaves=30,
)


def _valid_dict() -> dict[str, Any]:
    return layout_of(make_state(1, small=3)).to_dict()


@settings(max_examples=300, deadline=None)
@given(value=_json_values)
def test_arbitrary_json_is_rejected_cleanly(value: Any) -> None:
    raw = json.dumps(value).encode()
    with contextlib.suppress(MetadataError):
        Layout.from_json(raw)


@settings(max_examples=300, deadline=None)
@given(
    key=st.sampled_from(["format", "bucket_bytes", "alignment", "tensors", "digest"]),
    value=_json_values,
)
def test_mutated_fields_are_rejected_cleanly(key: str, value: Any) -> None:
    data = _valid_dict()
    assume(not (type(value) is type(data[key]) and value == data[key]))  # a real change
    data[key] = value
    with pytest.raises(MetadataError):
        Layout.from_json(json.dumps(data))


@settings(max_examples=300, deadline=None)
@given(position=st.integers(0, 40), entry=_json_values)
def test_mutated_tensor_entries_are_rejected_cleanly(position: int, entry: Any) -> None:
    data = _valid_dict()
    tensors = data["tensors"]
    tensors[position % len(tensors)] = entry
    with pytest.raises(MetadataError):
        Layout.from_json(json.dumps(data))


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200))
def test_random_bytes_are_rejected_cleanly(raw: bytes) -> None:
    with contextlib.suppress(MetadataError):
        Layout.from_json(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 100_000,
        b'{"a":' * 50_000,
        b"x" * 100,
        b"\xff\xfe\x00",
        b"",
        b'{"format":1,"alignment":512,"bucket_bytes":1024,"tensors":[["a",[1e400],"float32"]],"digest":""}',
        b'{"format":1,"alignment":512,"bucket_bytes":1024,"tensors":[["a",[-1],"float32"]],"digest":""}',
        b'{"format":1,"alignment":512,"bucket_bytes":1024,"tensors":[["a",[99999999999,999999999],"float64"]],'
        b'"digest":""}',
        b'{"format":1,"alignment":512,"bucket_bytes":1024,"tensors":[["a",[1],"pickle"]],"digest":""}',
        b'{"format":1,"alignment":512,"bucket_bytes":1024,"tensors":[["a",[1],"float32"],["a",[1],"float32"]]}',
    ],
)
def test_known_hostile_inputs(raw: bytes) -> None:
    with pytest.raises(MetadataError):
        Layout.from_json(raw)


def test_oversized_metadata_is_refused_before_parsing() -> None:
    raw = layout_of(make_state(1)).to_json()
    with pytest.raises(MetadataError, match="limit"):
        Layout.from_json(raw, max_bytes=len(raw) - 1)
    with pytest.raises(MetadataError, match="limit"):
        Layout.from_json(b" " * (64 * 1024 * 1024 + 1))


def test_adopt_keeps_values_and_objects_and_flat_block_recognizes_the_block() -> None:
    from rlfleet.weightsync import adopt, flat_block, flat_views

    g = torch.Generator().manual_seed(5)
    state = {
        "w": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "t": torch.randn(40, 24, generator=g).t(),  # non-contiguous: becomes a contiguous view
        "ids": torch.randint(0, 1000, (9,), generator=g),
        "flag": torch.tensor(True),
        "none": torch.zeros(0, 3),
    }
    param = torch.nn.Parameter(torch.randn(8, generator=g))
    state["p"] = param
    before = checksum(state)
    layout = Layout.from_state_dict(state, 1024)
    assert flat_block(layout, state) is None  # scattered
    block = adopt(state, layout)
    assert checksum(state) == before
    assert state["p"] is param
    assert param.requires_grad
    found = flat_block(layout, state)
    assert found is not None
    assert found.data_ptr() == block.data_ptr()
    assert found.numel() == layout.padded_bytes
    views = flat_views(layout, found)
    for name, tensor in state.items():
        assert views[name].data_ptr() == tensor.data_ptr() or not tensor.numel()

    moved = dict(state)
    moved["ids"] = state["ids"].clone()  # one tensor elsewhere: not a block any more
    assert flat_block(layout, moved) is None
    with torch.no_grad():
        state["w"].data = state["w"].data[:, :].t().t()  # same place, still contiguous
    assert flat_block(layout, state) is not None

    with pytest.raises(LayoutMismatchError):
        adopt({"w": torch.zeros(2)}, layout)


def test_flat_block_never_reads_ahead_of_a_lazy_mapping() -> None:
    from collections.abc import Iterator, Mapping

    from rlfleet.weightsync import adopt, flat_block

    state = {"a": torch.ones(4), "b": torch.zeros(3)}
    layout = Layout.from_state_dict(state, 1024)
    adopt(state, layout)

    class Lazy(Mapping[str, torch.Tensor]):  # e.g. a gather per parameter on access
        reads = 0

        def __getitem__(self, key: str) -> torch.Tensor:
            Lazy.reads += 1
            return state[key]

        def __iter__(self) -> Iterator[str]:
            return iter(state)

        def __len__(self) -> int:
            return len(state)

    assert flat_block(layout, Lazy()) is None
    assert Lazy.reads == 0
    assert flat_block(layout, state) is not None


# -- dense packing, bounds and clear errors ---------------------------------------------------
def test_many_tiny_tensors_cost_their_own_bytes_not_512_each() -> None:
    from rlfleet.weightsync.protocol._wire import bucket_segments

    sd = {f"t{i}": torch.full((4,), float(i)) for i in range(100_000)}  # 1.6 MB of data
    layout = Layout.from_state_dict(sd)
    assert layout.total_bytes == 1_600_000
    assert layout.padded_bytes < 1_600_000 + 512 * len(layout.buckets)  # was 51.2 MB
    on_wire = sum(s.nbytes for b in layout.buckets for s in bucket_segments(layout, b.index))
    assert on_wire == 1_600_000
    flat = pack_all(layout, sd)
    views = flat_views(layout, flat)
    assert torch.equal(views["t99999"], sd["t99999"])
    assert checksum(views) == checksum(sd)


def test_mixed_dtypes_stay_aligned_to_their_element_size_and_round_trip() -> None:
    sd = {
        "flag": torch.tensor([True]),
        "half": torch.ones(3, dtype=torch.float16),
        "c": torch.full((1,), 1 + 2j, dtype=torch.complex128),
        "big": torch.ones(DENSE_BELOW // 4 + 1),
        "byte": torch.ones(1, dtype=torch.uint8),
    }
    layout = Layout.from_state_dict(sd)
    assert layout["c"].offset % 16 == 0
    assert layout["half"].offset % 2 == 0
    assert layout["big"].offset % ALIGNMENT == 0
    assert checksum(flat_views(layout, pack_all(layout, sd))) == checksum(sd)


@pytest.mark.parametrize("shape", [[0, 10**30], [2**62, 0], [0, -1]])
def test_absurd_shapes_are_refused(shape: list[int]) -> None:
    with pytest.raises(MetadataError, match="invalid shape"):
        Layout([("w", shape, "float32")])


def test_a_state_dict_of_non_tensors_is_a_clear_error() -> None:
    with pytest.raises(TypeError, match=r"'w' is a list, not a torch\.Tensor"):
        Layout.from_state_dict({"w": [1, 2]})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="mapping"):
        Layout.from_state_dict([("w", torch.zeros(1))])  # type: ignore[arg-type]


@pytest.mark.parametrize("raw", [None, 3, ["x"]])
def test_layout_from_json_of_a_non_text_value_is_a_metadata_error(raw: Any) -> None:
    with pytest.raises(MetadataError, match="bytes or text"):
        Layout.from_json(raw)


def test_a_mismatch_names_a_parameter_with_quotes_exactly() -> None:
    sd = {"it's": torch.zeros(3), "b": torch.zeros(2)}
    other = {"it's": torch.zeros(4), "b": torch.zeros(2)}
    with pytest.raises(LayoutMismatchError) as info:
        Layout.from_state_dict(sd).require_same(Layout.from_state_dict(other))
    assert info.value.parameter == "it's"
    found = Layout.from_state_dict(sd).difference(Layout.from_state_dict(other))
    assert found is not None
    assert found[0] == "it's"


def test_identical_infinities_are_equal_fingerprints() -> None:
    mask = torch.full((4, 4), float("-inf")).triu(1)
    sd = {"mask": mask, "pos": torch.full((3,), float("inf")), "w": torch.ones(3)}
    assert compare_fingerprints(fingerprint(sd), fingerprint({k: v.clone() for k, v in sd.items()})) == []
    assert compare_fingerprints({"x": float("inf")}, {"x": float("-inf")}) != []
    assert compare_fingerprints({"x": float("nan")}, {"x": float("nan")}) != []
    assert compare_fingerprints({"x": float("inf")}, {"x": 1.0}) != []


def test_adopt_keeps_views_of_another_tensor_shared() -> None:
    from rlfleet.weightsync import adopt

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"base": base, "row": base[1], "col": base[:, 2], "bytes": base.view(torch.int32)[3]}
    values = {k: v.clone() for k, v in state.items()}
    adopt(state, Layout.from_state_dict(state, 1024))
    assert all(torch.equal(state[k], values[k]) for k in state)
    with torch.no_grad():
        state["base"][1, 2] = -7.0
    assert state["row"][2] == -7.0
    assert state["col"][1] == -7.0
    assert state["bytes"].untyped_storage().data_ptr() == state["base"].untyped_storage().data_ptr()


def test_adopt_refuses_overlap_that_no_tensor_holds() -> None:
    from rlfleet.weightsync import adopt

    flat = torch.arange(10, dtype=torch.float32)
    state = {"left": flat[:6], "right": flat[4:]}
    layout = Layout.from_state_dict(state, 1024)
    with pytest.raises(ValueError, match="share memory"):
        adopt(state, layout)
    assert torch.equal(state["left"], torch.arange(6, dtype=torch.float32))  # nothing moved
