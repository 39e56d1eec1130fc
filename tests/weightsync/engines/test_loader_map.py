"""The engine's loader as the map: a dry run of a plain torch model's fused ``load_weights``.

`Fused` loads the way vLLM's layers do (q/k/v into one stacked parameter, gate/up into another,
a tensor-parallel rank's rows or columns with ``narrow``, a padded vocabulary whose padding the
loader zeroes, a weight cast to the parameter's dtype, a tied ``lm_head.weight`` ignored), with
nothing of vLLM. The real vLLM loader is checked the same way in `tests/e2e/test_vllm.py`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

from rlfleet.weightsync import (
    Layout,
    LayoutMismatchError,
    LoaderMap,
    LoadWeightsConsumer,
    MetadataError,
    SharedBuffer,
    SharedBufferReader,
    record_loader_map,
)
from rlfleet.weightsync.engines import Cast, Drop, MapAssemble, UnmappableLoaderError

H, Q, KV, INTER, VOCAB, PADDED = 8, 8, 4, 12, 10, 12
SHAPES = {
    "embed_tokens.weight": (VOCAB, H),
    "q_proj.weight": (Q, H),
    "k_proj.weight": (KV, H),
    "v_proj.weight": (KV, H),
    "o_proj.weight": (H, Q),
    "gate_proj.weight": (INTER, H),
    "up_proj.weight": (INTER, H),
    "norm.weight": (H,),
    "lm_head.weight": (VOCAB, H),
}


class Fused(nn.Module):
    """One tensor-parallel rank of a vLLM-shaped model (see the module doc)."""

    def __init__(self, rank: int = 0, tp: int = 1, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.full(shape, 3.0, dtype=dtype), requires_grad=False)

        self.embed = param(PADDED // tp, H)
        self.qkv = param((Q + 2 * KV) // tp, H)
        self.o = param(H, Q // tp)
        self.gate_up = param(2 * INTER // tp, H)
        self.norm = param(H)
        self.register_buffer("inv_freq", torch.ones(4))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        r, tp = self.rank, self.tp
        loaded = set()
        for name, w in weights:
            if name == "embed_tokens.weight":
                rows = PADDED // tp
                lo, hi = r * rows, min(r * rows + rows, VOCAB)
                self.embed.data[: hi - lo].copy_(w[lo:hi])
                self.embed.data[hi - lo :].fill_(0)
            elif name in ("q_proj.weight", "k_proj.weight", "v_proj.weight"):
                size = {"q": Q, "k": KV, "v": KV}[name[0]] // tp
                offset = {"q": 0, "k": Q // tp, "v": (Q + KV) // tp}[name[0]]
                self.qkv.data.narrow(0, offset, size).copy_(w.narrow(0, r * size, size))
            elif name in ("gate_proj.weight", "up_proj.weight"):
                size = INTER // tp
                self.gate_up.data.narrow(0, 0 if name[0] == "g" else size, size).copy_(
                    w.narrow(0, r * size, size)
                )
            elif name == "o_proj.weight":
                size = Q // tp
                self.o.data.copy_(w.narrow(1, r * size, size).to(self.o.dtype))
            elif name == "norm.weight":
                self.norm.data.copy_(w)
            elif name == "lm_head.weight":
                continue  # tied to the embedding
            else:
                raise ValueError(f"There is no module or parameter named {name!r}")
            loaded.add(name)
        return loaded


def checkpoint(version: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(*s, generator=g).to(dtype) for n, s in SHAPES.items()}


def entries(dtype: torch.dtype = torch.float32) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(n, s, dtype) for n, s in SHAPES.items()]


def loaded(version: int, rank: int = 0, tp: int = 1) -> dict[str, torch.Tensor]:
    model = Fused(rank, tp)
    model.load_weights(checkpoint(version).items())
    return {n: p.detach() for n, p in model.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def assembled(loader_map: LoaderMap, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    stage = MapAssemble(loader_map)
    out = {name: t for n, w in weights for name, t in stage.feed(n, w)}
    assert not list(stage.finish())
    return out


@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (0, 2), (1, 2)])
def test_both_recorders_read_the_same_map_and_leave_the_model_untouched(rank: int, tp: int) -> None:
    model = Fused(rank, tp)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    by_dispatch = record_loader_map(model.load_weights, model, entries())
    by_markers = record_loader_map(model.load_weights, model, entries(), method="markers")
    assert same(before, {n: p.detach() for n, p in model.named_parameters()})
    assert sorted(by_dispatch.pieces, key=repr) == sorted(by_markers.pieces, key=repr)
    assert by_dispatch.fills == by_markers.fills
    assert by_dispatch.unused() == ["lm_head.weight"]
    assert by_dispatch.uncovered() == {}
    assert by_dispatch.landing_dtypes()["q_proj.weight"] == "bfloat16"


@pytest.mark.parametrize(("rank", "tp"), [(0, 1), (1, 2)])
def test_the_map_reproduces_load_weights_bit_exactly_over_three_versions(rank: int, tp: int) -> None:
    model = Fused(rank, tp)
    loader_map = record_loader_map(model.load_weights, model, entries())
    for version in (1, 2, 3):
        reference = loaded(version, rank, tp)
        in_place = {n: torch.full_like(t, math.nan) for n, t in reference.items()}
        loader_map.apply(checkpoint(version).items(), in_place)
        assert same(in_place, reference)
        assert same(assembled(loader_map, checkpoint(version).items()), reference)


def test_at_tensor_parallel_2_each_rank_needs_exactly_its_slice() -> None:
    models = [Fused(r, 2) for r in (0, 1)]
    maps = [record_loader_map(m.load_weights, m, entries()) for m in models]
    needed = [m.needed() for m in maps]
    assert needed[0]["q_proj.weight"] == ((0, 4), (0, H))
    assert needed[1]["q_proj.weight"] == ((4, 8), (0, H))
    assert needed[0]["o_proj.weight"] == ((0, H), (0, 4))
    assert needed[1]["o_proj.weight"] == ((0, H), (4, 8))
    assert needed[1]["embed_tokens.weight"] == ((6, VOCAB), (0, H))  # the padding is the loader's zeros
    assert needed[0]["norm.weight"] == needed[1]["norm.weight"] == ((0, H),)
    for rank, loader_map in enumerate(maps):
        for version in (1, 2, 3):
            full = checkpoint(version)
            # everything outside the rank's slice is poisoned: only the slice may reach its parameters
            poisoned = {n: torch.full_like(t, math.nan) for n, t in full.items()}
            for name, box in needed[rank].items():
                index = tuple(slice(a, b) for a, b in box)
                poisoned[name][index] = full[name][index]
            slices = {
                n: poisoned[n][tuple(slice(a, b) for a, b in box)].clone() for n, box in needed[rank].items()
            }
            reference = loaded(version, rank, 2)
            assert same(assembled(loader_map, poisoned.items()), reference)
            assert same(assembled(loader_map.sliced(), slices.items()), reference)


def test_derived_transforms_drop_what_the_loader_ignores_and_cast_to_the_landing_dtype() -> None:
    model = Fused()
    stages = record_loader_map(model.load_weights, model, entries()).transforms()
    assert isinstance(stages[0], Drop)
    assert stages[0].pattern.search("lm_head.weight")
    casts = [s for s in stages if isinstance(s, Cast)]
    assert len(casts) == 1
    assert casts[0].dtype == torch.bfloat16
    consumer = LoadWeightsConsumer(Layout(entries_for_layout(), 4096), model.load_weights, transforms=stages)
    assert all(dtype == "bfloat16" for _, _, dtype in consumer.plan)
    assert "lm_head.weight" not in {name for name, _, _ in consumer.plan}


def entries_for_layout() -> list[tuple[str, tuple[int, ...], str]]:
    return [(n, s, "float32") for n, s in SHAPES.items()]


def test_assembled_parameters_checked_against_the_engine_and_applied_through_the_node_buffer() -> None:
    engine = Fused(1, 2)
    loader_map = record_loader_map(engine.load_weights, engine, entries())
    params = dict(engine.named_parameters())

    def copy_in(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            params[name].data.copy_(tensor)

    layout = Layout(entries_for_layout(), bucket_bytes=1024)
    consumer = LoadWeightsConsumer(layout, copy_in, transforms=[loader_map.assemble()], expected=params)
    with SharedBuffer(layout, 1, checksums=True) as node, SharedBufferReader.attach(node.name) as reader:
        for version in (1, 2, 3):
            node.publish(checkpoint(version), version)
            reader.copy_version(version, consumer, 30.0)
            assert same({n: p.detach() for n, p in params.items()}, loaded(version, 1, 2))


def test_the_map_travels_as_json() -> None:
    model = Fused(1, 2)
    loader_map = record_loader_map(model.load_weights, model, entries())
    again = LoaderMap.from_json(loader_map.to_json())
    assert again.pieces == loader_map.pieces
    assert again.fills == loader_map.fills
    assert dict(again.sources) == dict(loader_map.sources)
    assert dict(again.params) == dict(loader_map.params)
    with pytest.raises(MetadataError, match=r"malformed|box"):
        LoaderMap.from_json('{"sources": [], "params": [], "pieces": [["a", [[0]], "b", []]], "fills": []}')


class Computing(nn.Module):
    """A loader that scales what it loads: no copy map exists for it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 2), requires_grad=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, w in weights:
            self.w.data.copy_(w * 2)


def test_a_loader_that_computes_is_refused_by_both_recorders_naming_the_parameter() -> None:
    model = Computing()
    with pytest.raises(UnmappableLoaderError, match=r"'w'.*computed.*markers"):
        record_loader_map(model.load_weights, model, [("x", (4, 2), torch.float32)])
    with pytest.raises(UnmappableLoaderError, match=r"'w'"):
        record_loader_map(model.load_weights, model, [("x", (4, 2), torch.float32)], method="markers")


def test_uncovered_parameters_and_unknown_or_misshaped_tensors_are_named() -> None:
    model = Fused()
    partial = [e for e in entries() if e[0] != "k_proj.weight"]
    loader_map = record_loader_map(model.load_weights, model, partial)
    assert loader_map.uncovered() == {"qkv": KV * H}
    with pytest.raises(LayoutMismatchError, match="'qkv'") as info:
        loader_map.require_covered()
    assert info.value.parameter == "qkv"
    full = record_loader_map(model.load_weights, model, entries())
    stage = full.assemble()
    with pytest.raises(LayoutMismatchError, match="'nope'"):
        list(stage.feed("nope", torch.zeros(1)))
    with pytest.raises(LayoutMismatchError, match=r"'norm\.weight'"):
        list(stage.feed("norm.weight", torch.zeros(3)))
    list(stage.feed("q_proj.weight", torch.zeros(Q, H)))
    with pytest.raises(LayoutMismatchError, match="incomplete"):
        list(stage.finish())
    with pytest.raises(ValueError, match="method"):
        record_loader_map(model.load_weights, model, entries(), method="guess")  # type: ignore[arg-type]


def test_what_load_weights_itself_raises_passes_through_the_dry_run() -> None:
    model = Fused()
    with pytest.raises(ValueError, match=r"no module or parameter named 'module\.norm\.weight'") as info:
        record_loader_map(model.load_weights, model, [("module.norm.weight", (H,), torch.float32)])
    assert not isinstance(info.value, UnmappableLoaderError)  # a layout error, not an unreadable loader


def test_a_loader_writing_outside_the_model_is_named() -> None:
    with pytest.raises(ValueError, match=r"'embed_tokens\.weight'.*none of the model's"):
        record_loader_map(Fused().load_weights, Fused(), entries())


def test_a_module_free_params_dict_is_enough() -> None:
    model = Fused()
    params: dict[str, Any] = dict(model.named_parameters())
    loader_map = record_loader_map(model.load_weights, params, entries())
    assert {p.param for p in loader_map.pieces} == set(params)
