"""The engine's own loader as the map: for each trainer tensor, where in the engine it lands.

An engine's ``load_weights`` knows how checkpoint tensors become its parameters (q/k/v stacked
into one ``qkv_proj``, a tensor-parallel rank's rows or columns, vocabulary padding). A
`LoaderMap` is that knowledge as data, recorded once by a dry run of the loader
(`record_loader_map`): *pieces* (``source[source_box]`` is copied, cast, into
``param[param_box]``) and *fills* (elements the loader sets to a constant). From it rlfleet
derives what it would otherwise be told per model:

- `transforms()`: what to put between the wire and that same ``load_weights`` (`Drop` the
  tensors it ignores, such as a tied ``lm_head.weight``; `Cast` each tensor to the dtype it
  lands in);
- `assemble()`: a transform that builds the engine's parameters themselves (fused, sliced,
  cast), so a consumer can check them against the engine (`expected`) and copy them in place;
- `needed()`: the slice of each trainer tensor this engine rank reads, so a tensor-parallel
  rank can be sent only its shard (`sliced()` is the map over those slices).

Torch only: the map is built from any ``load_weights`` (vLLM's, SGLang's, a user's) and is
JSON-safe data (`to_json`), so it can travel to the trainer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlfleet.weightsync._errors import LayoutMismatchError, MetadataError
from rlfleet.weightsync.engines._transforms import Cast, Drop, WeightTransform
from rlfleet.weightsync.layout._dtypes import dtype_from_name

__all__ = ["Box", "Fill", "LoaderMap", "MapAssemble", "Piece", "UnmappableLoaderError"]

#: A dense box: one ``(start, stop)`` per dimension.
Box = tuple[tuple[int, int], ...]
TensorEntry = tuple[tuple[int, ...], str]
Weight = tuple[str, torch.Tensor]


def box_index(box: Box) -> tuple[slice, ...]:
    """The indexing tuple that selects `box`."""
    return tuple(slice(a, b) for a, b in box)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def _overlap(a: Box, b: Box) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


def _hull(a: Box, b: Box) -> Box:
    return tuple((min(x0, y0), max(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))


class UnmappableLoaderError(ValueError):
    """The dry run saw the loader write what no copy map can say (a value it computes, a
    transposed copy): there is no `LoaderMap` for this model (the model itself is untouched)."""


@dataclass(frozen=True)
class Piece:
    """``source[source_box]`` is copied (cast to the parameter's dtype) into ``param[param_box]``."""

    source: str
    source_box: Box
    param: str
    param_box: Box


@dataclass(frozen=True)
class Fill:
    """The loader sets ``param[box]`` to the constant `value` (e.g. vocabulary padding to 0)."""

    param: str
    box: Box
    value: float


def _box_of(value: Any, what: str) -> Box:
    if not isinstance(value, list) or not all(
        isinstance(d, list)
        and len(d) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in d)
        and d[0] <= d[1]
        for d in value
    ):
        raise MetadataError(f"loader map: {what} is not a box ([[start, stop], ...]): {value!r:.120}")
    return tuple((int(a), int(b)) for a, b in value)


@dataclass(frozen=True)
class LoaderMap:
    """Where each trainer tensor lands in one engine rank (see the module doc).

    `sources`: the trainer tensors the dry run fed, ``name -> (shape, dtype)``; `params`: the
    engine rank's parameters, ``name -> (shape, dtype)``; `pieces` in the order the loader wrote
    them (a later piece overwrites an earlier one where they overlap); `fills` likewise.
    """

    sources: Mapping[str, TensorEntry]
    params: Mapping[str, TensorEntry]
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...] = ()
    _by_param: dict[str, list[Piece]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for piece in self.pieces:
            if piece.source not in self.sources or piece.param not in self.params:
                raise MetadataError(f"loader map: piece {piece} names an unknown tensor")
            if box_shape(piece.source_box) != box_shape(piece.param_box):
                raise MetadataError(f"loader map: piece {piece} copies between boxes of different shapes")
            for box, (shape, _) in (
                (piece.source_box, self.sources[piece.source]),
                (piece.param_box, self.params[piece.param]),
            ):
                if len(box) != len(shape) or any(b > n for (_, b), n in zip(box, shape, strict=True)):
                    raise MetadataError(f"loader map: piece {piece} leaves its tensor of shape {shape}")
            self._by_param.setdefault(piece.param, []).append(piece)

    # -- what the loader does -------------------------------------------------------------
    def unused(self) -> list[str]:
        """Trainer tensors the loader never reads (a tied ``lm_head.weight``, ``rotary_emb.inv_freq``)."""
        used = {p.source for p in self.pieces}
        return [name for name in self.sources if name not in used]

    def uncovered(self) -> dict[str, int]:
        """Parameters with elements the loader never writes, and how many (upper bound if overlapping)."""
        out: dict[str, int] = {}
        for name, (shape, _) in self.params.items():
            boxes = [p.param_box for p in self._by_param.get(name, [])]
            boxes += [f.box for f in self.fills if f.param == name]
            written = sum(box_numel(b) for b in boxes)
            disjoint = all(not _overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
            if not disjoint:
                mask = torch.zeros(shape, dtype=torch.bool)
                for b in boxes:
                    mask[box_index(b)] = True
                written = int(mask.sum())
            missing = math.prod(shape) - written
            if missing:
                out[name] = missing
        return out

    def require_covered(self) -> None:
        """LayoutMismatchError naming the first parameter the trainer's tensors leave (partly) unset."""
        uncovered = self.uncovered()
        if uncovered:
            name, count = next(iter(uncovered.items()))
            shape, _ = self.params[name]
            raise LayoutMismatchError(
                f"the engine's load_weights never writes {count} of the {math.prod(shape)} elements of "
                f"{name!r} from the trainer's tensors ({len(uncovered)} parameter(s) in all): the "
                "trainer's layout lacks what it is loaded from",
                name,
            )

    def needed(self) -> dict[str, Box]:
        """Per trainer tensor this rank reads, the bounding box of what it reads (its shard)."""
        out: dict[str, Box] = {}
        for piece in self.pieces:
            box = out.get(piece.source)
            out[piece.source] = piece.source_box if box is None else _hull(box, piece.source_box)
        return out

    def landing_dtypes(self) -> dict[str, str]:
        """Trainer tensor -> the one dtype it lands in (tensors landing in several dtypes left out)."""
        seen: dict[str, set[str]] = {}
        for piece in self.pieces:
            seen.setdefault(piece.source, set()).add(self.params[piece.param][1])
        return {name: next(iter(dtypes)) for name, dtypes in seen.items() if len(dtypes) == 1}

    # -- derived ---------------------------------------------------------------------------
    def sliced(self) -> LoaderMap:
        """The map over only the slices this rank reads: each source is its `needed()` box."""
        needed = self.needed()
        sources = {name: (box_shape(box), self.sources[name][1]) for name, box in needed.items()}
        pieces = tuple(
            replace(
                p,
                source_box=tuple(
                    (a - o, b - o) for (a, b), (o, _) in zip(p.source_box, needed[p.source], strict=True)
                ),
            )
            for p in self.pieces
        )
        return LoaderMap(sources, dict(self.params), pieces, self.fills)

    def transforms(self) -> list[WeightTransform]:
        """What to put before the engine's own ``load_weights``: drop what it ignores, cast each
        tensor to the dtype it lands in (the loader's own cast then does nothing)."""
        stages: list[WeightTransform] = []
        unused = self.unused()
        if unused:
            stages.append(Drop(_exact(unused)))
        by_dtype: dict[str, list[str]] = {}
        for name, dtype in self.landing_dtypes().items():
            if dtype != self.sources[name][1] and dtype_from_name(dtype).is_floating_point:
                by_dtype.setdefault(dtype, []).append(name)
        stages += [Cast(dtype, only=_exact(names)) for dtype, names in sorted(by_dtype.items())]
        return stages

    def assemble(self) -> MapAssemble:
        """A transform that turns the trainer's tensors into the engine's parameters."""
        return MapAssemble(self)

    @torch.no_grad()
    def apply(self, weights: Iterable[Weight], params: Mapping[str, torch.Tensor]) -> None:
        """Copy `weights` into `params` in place, piece by piece, as ``load_weights`` would."""
        by_source: dict[str, list[Piece]] = {}
        for piece in self.pieces:
            by_source.setdefault(piece.source, []).append(piece)
        for fill in self.fills:
            params[fill.param][box_index(fill.box)].fill_(fill.value)
        for name, tensor in weights:
            self._check_source(name, tensor)
            for piece in by_source.get(name, []):
                target = params[piece.param][box_index(piece.param_box)]
                target.copy_(tensor[box_index(piece.source_box)])

    def _check_source(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.sources.get(name)
        if entry is None:
            raise LayoutMismatchError(f"{name!r} is not a trainer tensor of this loader map", name)
        if tuple(tensor.shape) != entry[0]:
            raise LayoutMismatchError(
                f"{name!r} is {tuple(tensor.shape)}, the loader map expects {entry[0]}", name
            )

    # -- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            {
                "sources": [[n, list(s), d] for n, (s, d) in self.sources.items()],
                "params": [[n, list(s), d] for n, (s, d) in self.params.items()],
                "pieces": [
                    [p.source, [list(x) for x in p.source_box], p.param, [list(x) for x in p.param_box]]
                    for p in self.pieces
                ],
                "fills": [[f.param, [list(x) for x in f.box], f.value] for f in self.fills],
            }
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> LoaderMap:
        try:
            data = json.loads(raw)
            sources = _entries(data["sources"], "sources")
            params = _entries(data["params"], "params")
            pieces = tuple(
                Piece(str(s), _box_of(sb, f"piece {i}"), str(p), _box_of(pb, f"piece {i}"))
                for i, (s, sb, p, pb) in enumerate(data["pieces"])
            )
            fills = tuple(
                Fill(str(p), _box_of(b, f"fill {i}"), float(v)) for i, (p, b, v) in enumerate(data["fills"])
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataError(f"loader map JSON is malformed: {exc}") from exc
        return cls(sources, params, pieces, fills)


def _entries(rows: Any, what: str) -> dict[str, TensorEntry]:
    out: dict[str, TensorEntry] = {}
    for row in rows:
        name, shape, dtype = row
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise MetadataError(f"loader map: a {what} row is not [name, shape, dtype]: {row!r:.120}")
        dtype_from_name(dtype)
        out[name] = (tuple(int(d) for d in shape), dtype)
    return out


def _exact(names: Sequence[str]) -> str:
    return "^(?:" + "|".join(re.escape(n) for n in names) + ")$"


class MapAssemble(WeightTransform):
    """Builds each engine parameter from the trainer's tensors with the loader map's pieces.

    A parameter is yielded (its name, shape and dtype, on the device of the tensors fed) once
    every piece of it arrived; trainer tensors the loader ignores are dropped; a tensor the map
    does not know, or of another shape, is a `LayoutMismatchError`. `finish` raises naming a
    parameter still missing pieces. Runs on meta tensors too (`plan_transforms`).
    """

    def __init__(self, loader_map: LoaderMap) -> None:
        loader_map.require_covered()
        self.map = loader_map
        self._by_source: dict[str, list[Piece]] = {}
        self._count: dict[str, int] = {}
        for piece in loader_map.pieces:
            self._by_source.setdefault(piece.source, []).append(piece)
            self._count[piece.param] = self._count.get(piece.param, 0) + 1
        self._fills: dict[str, list[Fill]] = {}
        for fill in loader_map.fills:
            self._fills.setdefault(fill.param, []).append(fill)
        self._partial: MutableMapping[str, torch.Tensor] = {}
        self._left: dict[str, int] = {}
        self.start()

    def start(self) -> None:
        self._partial = {}
        self._left = dict(self._count)

    def _buffer(self, param: str, like: torch.Tensor) -> torch.Tensor:
        buf = self._partial.get(param)
        if buf is None:
            shape, dtype = self.map.params[param]
            buf = torch.empty(shape, dtype=dtype_from_name(dtype), device=like.device)
            if not buf.is_meta:
                for fill in self._fills.get(param, []):
                    buf[box_index(fill.box)].fill_(fill.value)
            self._partial[param] = buf
        return buf

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        self.map._check_source(name, tensor)
        for piece in self._by_source.get(name, []):
            if self._left.get(piece.param, 0) <= 0:
                raise LayoutMismatchError(
                    f"{name!r} arrived twice in one version (for {piece.param!r})", name
                )
            buf = self._buffer(piece.param, tensor)
            if not buf.is_meta:
                with torch.no_grad():
                    buf[box_index(piece.param_box)].copy_(tensor[box_index(piece.source_box)])
            self._left[piece.param] -= 1
            if self._left[piece.param] == 0:
                yield piece.param, self._partial.pop(piece.param)

    def finish(self) -> Iterator[Weight]:
        missing = [name for name, left in self._left.items() if left]
        if missing:
            self.start()
            sources = sorted({p.source for p in self.map.pieces if p.param == missing[0]})
            raise LayoutMismatchError(
                f"engine parameter {missing[0]!r} is incomplete: not every one of {sources} arrived "
                f"({len(missing)} parameter(s) incomplete)",
                missing[0],
            )
        return iter(())
