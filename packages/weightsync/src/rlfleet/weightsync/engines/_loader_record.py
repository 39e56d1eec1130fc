"""A dry run of an engine's ``load_weights`` with recording tensors, read as a `LoaderMap`.

Two recorders, which agree wherever both apply:

- ``"dispatch"`` (default): the trainer's tensors are fed as meta tensors (nothing allocated);
  a `TorchDispatchMode` sees every write into the model's parameters and buffers, records
  each copy from a trainer tensor (which box of it, into which box of which parameter) and
  each constant fill, and *skips the write*: the model is left exactly as it was and no copy
  of it is made. A write it cannot read as a copy of a box or a fill (a value computed from a
  trainer tensor, a transposed copy) is refused, naming the parameter: use ``"markers"``.
- ``"markers"``: every trainer element is fed as its own id (float64, exact to 2**53) into
  float64 stand-ins of the parameters (the originals are put back afterwards); the ids read
  back say where each element landed through any value-preserving computation. Costs a
  float64 copy of the parameters and of the trainer's tensors for the duration of the run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlfleet.weightsync.engines._loader_map import Box, Fill, LoaderMap, Piece, UnmappableLoaderError
from rlfleet.weightsync.layout._dtypes import dtype_from_name, dtype_name

__all__ = ["record_loader_map"]

aten = torch.ops.aten
Entry = tuple[str, Sequence[int], "str | torch.dtype"]
#: Copies whose result holds the same elements as their input, in the same order.
_SAME_ELEMENTS = (aten._to_copy.default, aten.clone.default)
MARKER_LIMIT = 2**53


def _key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


@dataclass(frozen=True)
class _Base:
    """A named tensor's storage: `offset` of its first element; `origin` shifts a derived copy's
    coordinates into the named tensor's."""

    name: str
    offset: int
    shape: tuple[int, ...]
    origin: tuple[int, ...]

    def box(self, view: torch.Tensor) -> Box | None:
        """The box `view` covers in the named tensor, or None if it is not a dense box of it."""
        if view.dim() != len(self.shape) or view.numel() == 0:
            return None
        rel = view.storage_offset() - self.offset
        starts = []
        for n, step in zip(self.shape, _strides(self.shape), strict=True):
            starts.append(rel // step)
            rel %= step
            if starts[-1] < 0 or starts[-1] >= max(n, 1):
                return None
        if rel or any(
            size > 1 and stride != step
            for size, stride, step in zip(view.shape, view.stride(), _strides(self.shape), strict=True)
        ):
            return None
        if any(s + n > limit for s, n, limit in zip(starts, view.shape, self.shape, strict=True)):
            return None
        return tuple((s + o, s + o + n) for s, n, o in zip(starts, view.shape, self.origin, strict=True))

    def holds(self, view: torch.Tensor) -> bool:
        return self.offset <= view.storage_offset() < self.offset + max(math.prod(self.shape), 1)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors an op writes (its schema's ``a!`` arguments)."""
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = kwargs[arg.name] if arg.name in kwargs else (args[i] if i < len(args) else None)
        values = value if isinstance(value, (list, tuple)) else [value]
        yield from (v for v in values if isinstance(v, torch.Tensor))


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records writes into the model (see the module doc) and skips them."""

    def __init__(self, model: dict[int, list[tuple[_Base, bool]]], sources: dict[int, _Base]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.model = model  # storage -> (base, is a parameter)
        self.sources = sources
        self.pieces: list[Piece] = []
        self.fills: list[Fill] = []
        self.refused: list[str] = []

    def _target(self, tensor: torch.Tensor) -> tuple[_Base, bool] | None:
        for base, is_param in self.model.get(_key(tensor), []):
            if base.holds(tensor):
                return base, is_param
        return None

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        targets = [(t, hit) for t in _written(func, args, kwargs) if (hit := self._target(t)) is not None]
        if targets:
            for tensor, (base, is_param) in targets:
                if is_param and tensor.numel():
                    self._record(func, tensor, base, args)
            return kwargs.get("out", args[0])  # the model is never written
        if func is aten.copy_.default and not args[0].is_meta and _key(args[1]) in self.sources:
            raise ValueError(
                f"record_loader_map: load_weights copies {self.sources[_key(args[1])].name!r} into a tensor "
                "that is none of the model's parameters or buffers (is `model` the loader's own module?)"
            )
        out = func(*args, **kwargs)
        if func in _SAME_ELEMENTS and isinstance(out, torch.Tensor):
            self._derive(args[0], out)
        return out

    def _derive(self, src: torch.Tensor, out: torch.Tensor) -> None:
        base = self.sources.get(_key(src))
        box = None if base is None else base.box(src)
        if base is not None and box is not None and out.is_contiguous() and out.shape == src.shape:
            starts = tuple(a for a, _ in box)
            self.sources[_key(out)] = _Base(base.name, int(out.storage_offset()), tuple(out.shape), starts)

    def _record(self, func: Any, dst: torch.Tensor, base: _Base, args: tuple[Any, ...]) -> None:
        box = base.box(dst)
        what = f"{base.name!r}: {func}"
        if box is None:
            self.refused.append(f"{what} writes a region that is not a dense box of it")
        elif func is aten.copy_.default:
            src = args[1]
            source = self.sources.get(_key(src)) if isinstance(src, torch.Tensor) else None
            src_box = None if source is None else source.box(src)
            if source is None:
                self.refused.append(f"{what} copies a value computed by the loader, not a trainer tensor")
            elif src_box is None or tuple(src.shape) != tuple(dst.shape):
                self.refused.append(f"{what} copies {source.name!r} transposed or broadcast")
            else:
                self.pieces.append(Piece(source.name, src_box, base.name, box))
        elif func in (aten.fill_.Scalar, aten.zero_.default):
            self.fills.append(Fill(base.name, box, float(args[1]) if len(args) > 1 else 0.0))
        elif func is aten.fill_.Tensor and not args[1].is_meta:
            self.fills.append(Fill(base.name, box, float(args[1].item())))
        else:
            self.refused.append(f"{what} is neither a copy of a trainer tensor nor a constant fill")


def _named(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, Any]]:
    if isinstance(model, torch.nn.Module):
        return dict(model.named_parameters()), dict(model.named_buffers())
    return dict(model), {}


def _entries(entries: Iterable[Entry]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    out = []
    for name, shape, dtype in entries:
        out.append(
            (
                name,
                tuple(int(d) for d in shape),
                dtype if isinstance(dtype, torch.dtype) else dtype_from_name(dtype),
            )
        )
    if len({name for name, _, _ in out}) != len(out):
        raise ValueError("record_loader_map: a trainer tensor is named twice")
    return out


def _record_dispatch(load_weights: Callable[[Any], Any], model: Any, entries: list[Any]) -> LoaderMap:
    params, buffers = _named(model)
    table: dict[int, list[tuple[_Base, bool]]] = {}
    for group, is_param in ((params, True), (buffers, False)):
        for name, tensor in group.items():
            if is_param and not tensor.is_contiguous():
                raise ValueError(
                    f"record_loader_map: parameter {name!r} is not contiguous; use method='markers'"
                )
            base = _Base(name, tensor.storage_offset(), tuple(tensor.shape), (0,) * tensor.dim())
            table.setdefault(_key(tensor), []).append((base, is_param))
    feeds, sources = [], {}
    for name, shape, dtype in entries:
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        sources[_key(tensor)] = _Base(name, 0, shape, (0,) * len(shape))
        feeds.append((name, tensor))
    recorder = _Recorder(table, sources)
    with torch.no_grad(), recorder:
        load_weights(feeds)
    if recorder.refused:
        raise UnmappableLoaderError(
            f"record_loader_map: {len(recorder.refused)} write(s) cannot be read as copies "
            f"(first: {recorder.refused[0]}); record with method='markers'"
        )
    return _as_map(entries, params, recorder.pieces, recorder.fills)


def _as_map(
    entries: list[Any], params: Mapping[str, Any], pieces: list[Piece], fills: list[Fill]
) -> LoaderMap:
    return LoaderMap(
        {name: (shape, dtype_name(dtype)) for name, shape, dtype in entries},
        {name: (tuple(p.shape), dtype_name(p.dtype)) for name, p in params.items()},
        tuple(pieces),
        tuple(fills),
    )


def _dense_box(flat: torch.Tensor, shape: tuple[int, ...]) -> Box | None:
    """The box `flat` (indices into `shape`, row-major) fills exactly, or None."""
    if not shape:
        return ()
    coords = torch.stack(torch.unravel_index(flat, shape), -1)
    lo, hi = coords.min(0).values, coords.max(0).values + 1
    if int(torch.prod(hi - lo)) != flat.numel():
        return None
    return tuple((int(a), int(b)) for a, b in zip(lo.tolist(), hi.tolist(), strict=True))


def _param_pieces(
    name: str, ids: torch.Tensor, entries: list[Any], bases: list[int]
) -> tuple[list[Piece], list[str]]:
    """Marker ids in one parameter -> its pieces (one dense box per trainer tensor)."""
    flat = ids.reshape(-1)
    hit = flat > 0
    pieces, refused = [], []
    which = torch.bucketize(flat[hit], torch.tensor(bases), right=True) - 1
    positions = torch.nonzero(hit).reshape(-1)
    for index in sorted(set(which.tolist())):
        source, shape, _ = entries[index]
        sel = which == index
        pbox = _dense_box(positions[sel], tuple(ids.shape))
        cbox = _dense_box(flat[hit][sel] - bases[index], shape)
        order_ok = (
            pbox is not None
            and cbox is not None
            and [b - a for a, b in pbox] == [b - a for a, b in cbox]
            and torch.equal(
                ids[tuple(slice(a, b) for a, b in pbox)].reshape(-1),
                torch.arange(math.prod(shape)).view(shape)[tuple(slice(a, b) for a, b in cbox)].reshape(-1)
                + bases[index],
            )
        )
        if pbox is None or cbox is None or not order_ok:
            refused.append(f"{source!r} lands in {name!r} other than as one box in order")
        else:
            pieces.append(Piece(source, cbox, name, pbox))
    return pieces, refused


def _param_fills(name: str, values: torch.Tensor, constant: torch.Tensor) -> tuple[list[Fill], list[str]]:
    fills, refused = [], []
    positions = torch.nonzero(constant.reshape(-1)).reshape(-1)
    found = values.reshape(-1)[positions]
    for value in sorted(set(found.tolist())):
        box = _dense_box(positions[found == value], tuple(values.shape))
        if box is None:
            refused.append(f"{name!r} gets the constant {value} outside one box")
        else:
            fills.append(Fill(name, box, float(value)))
    return fills, refused


def _float64_run(
    load_weights: Callable[[Any], Any], params: Mapping[str, Any], feeds: list[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """What `load_weights` writes from `feeds` into NaN float64 stand-ins of `params` (put back after)."""
    originals = {name: p.data for name, p in params.items()}
    try:
        for p in params.values():
            p.data = torch.full(tuple(p.shape), math.nan, dtype=torch.float64, device=p.device)
        load_weights(feeds)
        return {name: p.data.detach().cpu() for name, p in params.items()}
    finally:
        for name, p in params.items():
            p.data = originals[name]


def _check_replay(
    load_weights: Callable[[Any], Any], params: Mapping[str, Any], loader_map: LoaderMap
) -> None:
    """Random values through `load_weights` and through the map must agree: a loader that computes
    (scales, sums) rather than copies could pass for a copy of other ids."""
    generator = torch.Generator().manual_seed(0)
    feeds = [
        (name, torch.randn(shape, generator=generator, dtype=torch.float64))
        for name, (shape, _) in loader_map.sources.items()
    ]
    seen = _float64_run(load_weights, params, feeds)
    mine = {name: torch.full(tuple(v.shape), math.nan, dtype=torch.float64) for name, v in seen.items()}
    loader_map.apply(feeds, mine)
    for name, values in seen.items():
        if not torch.equal(torch.nan_to_num(values, nan=0.5), torch.nan_to_num(mine[name], nan=0.5)):
            raise UnmappableLoaderError(
                f"record_loader_map: {name!r} gets values the recorded copies do not reproduce "
                "(the loader computes them): no loader map for this model"
            )


@torch.no_grad()
def _record_markers(load_weights: Callable[[Any], Any], model: Any, entries: list[Any]) -> LoaderMap:
    params, _ = _named(model)
    bases, feeds, base = [], [], 1
    for name, shape, _ in entries:
        bases.append(base)
        feeds.append((name, torch.arange(base, base + math.prod(shape), dtype=torch.float64).view(shape)))
        base += math.prod(shape)
        if base >= MARKER_LIMIT:
            raise ValueError("record_loader_map: more than 2**53 trainer elements; use method='dispatch'")
    seen = _float64_run(load_weights, params, feeds)
    pieces, fills, refused = [], [], []
    for name, values in seen.items():
        written = ~torch.isnan(values)
        is_id = written & (values == values.round()) & (values >= 1) & (values < base)
        ids = torch.where(is_id, values, torch.zeros_like(values)).to(torch.int64)
        found, bad = _param_pieces(name, ids, entries, bases)
        constants, bad_fills = _param_fills(name, values, written & ~is_id)
        pieces += found
        fills += constants
        refused += bad + bad_fills
    if refused:
        raise UnmappableLoaderError(f"record_loader_map: {refused[0]} ({len(refused)} problem(s) in all)")
    loader_map = _as_map(entries, params, pieces, fills)
    _check_replay(load_weights, params, loader_map)
    return loader_map


def record_loader_map(
    load_weights: Callable[[Any], Any],
    model: torch.nn.Module | Mapping[str, torch.Tensor],
    entries: Iterable[Entry],
    *,
    method: Literal["dispatch", "markers"] = "dispatch",
) -> LoaderMap:
    """Dry-run `load_weights` on the trainer tensors `entries` ((name, shape, dtype)) and read
    where each lands in `model` (a module, or its ``name -> parameter`` dict); see the module doc.

    The model keeps its values ("dispatch" never writes it; "markers" puts the originals back).
    Raises `UnmappableLoaderError` (a ValueError) naming a write the recorder cannot read as a
    copy; what ``load_weights`` itself raises (an unknown name, a wrong shape) passes through.
    """
    if method not in ("dispatch", "markers"):
        raise ValueError(f"record_loader_map: method must be 'dispatch' or 'markers', got {method!r}")
    if not callable(load_weights):
        raise TypeError(
            f"record_loader_map: load_weights must be callable, got {type(load_weights).__name__}"
        )
    listed = _entries(entries)
    record = _record_dispatch if method == "dispatch" else _record_markers
    return record(load_weights, model, listed)
