"""Reshard inputs: each side's parallelism (`Parallelism`) and the model's parameters (`ParamSpec`).

Rank convention (Megatron-LM's default order "tp-dp-pp"): tensor-parallel rank varies fastest,
then data-parallel, then pipeline stage. A parameter with ``layer`` lives on the stage owning that
layer; one without names its stage ("first", "last", "first_and_last", "all"). ``parts`` makes a
fused parameter: named pieces along ``fuse_dim`` (or its tensor-parallel dim), each split on its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rlfleet.placement._errors import ReshardError
from rlfleet.placement._public import public

__all__ = ["DTYPE_SIZES", "STAGES", "Hold", "Parallelism", "ParamSpec", "holds"]

STAGES = ("first", "last", "first_and_last", "all")

#: Element sizes of the dtypes a plan can carry (names as torch spells them, without "torch.").
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex32": 4,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
}

_AXES = ("tp", "dp", "pp")
_ALIASES = {
    "tp": "tp",
    "tensor_parallel_size": "tp",
    "tensor_model_parallel_size": "tp",
    "pp": "pp",
    "pipeline_parallel_size": "pp",
    "pipeline_model_parallel_size": "pp",
    "dp": "dp",
    "data_parallel_size": "dp",
}


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReshardError(f"{what} must be a positive int, got {value!r}")
    return value


# -- layouts ----------------------------------------------------------------------------------
@public
@dataclass(frozen=True)
class Parallelism:
    """Tensor, pipeline and data-parallel sizes of one side, and how ranks are numbered.

    ``order`` lists the axes fastest-varying first (default ``"tp-dp-pp"``, Megatron's).
    ``stage_layers`` gives the number of layers on each pipeline stage when the split is not
    the default even one.
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    order: str = "tp-dp-pp"
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for axis in _AXES:
            _positive_int(getattr(self, axis), f"parallelism {axis}")
        axes = tuple(self.order.split("-")) if isinstance(self.order, str) else ()
        if sorted(axes) != sorted(_AXES):
            raise ReshardError(f"parallelism order must be a permutation of tp-dp-pp, got {self.order!r}")
        if self.stage_layers is not None:
            layers = tuple(self.stage_layers)
            if len(layers) != self.pp or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in layers
            ):
                raise ReshardError(
                    f"stage_layers must list {self.pp} non-negative layer counts (one per stage), "
                    f"got {self.stage_layers!r}"
                )
            object.__setattr__(self, "stage_layers", layers)

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @cached_property
    def _strides(self) -> dict[str, int]:
        strides, stride = {}, 1
        for axis in self.order.split("-"):
            strides[axis] = stride
            stride *= getattr(self, axis)
        return strides

    def rank(self, *, tp: int = 0, pp: int = 0, dp: int = 0) -> int:
        """The rank at these coordinates."""
        for axis, value in (("tp", tp), ("pp", pp), ("dp", dp)):
            if not 0 <= value < getattr(self, axis):
                raise ReshardError(f"{axis} rank {value} outside 0..{getattr(self, axis) - 1}")
        s = self._strides
        return tp * s["tp"] + pp * s["pp"] + dp * s["dp"]

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(tp_rank, pp_rank, dp_rank) of `rank`."""
        if not 0 <= rank < self.world_size:
            raise ReshardError(f"rank {rank} outside a world of {self.world_size}")
        s = self._strides
        return (rank // s["tp"]) % self.tp, (rank // s["pp"]) % self.pp, (rank // s["dp"]) % self.dp

    def stage_ranks(self, stage: int) -> tuple[int, ...]:
        """Ranks of pipeline stage `stage`, ascending."""
        return tuple(r for r in range(self.world_size) if self.coords(r)[1] == stage)

    def layer_stages(self, num_layers: int) -> tuple[int, ...]:
        """The stage of each layer."""
        counts = self.stage_layers
        if counts is None:
            base, extra = divmod(num_layers, self.pp)
            counts = tuple(base + (1 if s < extra else 0) for s in range(self.pp))
        elif sum(counts) != num_layers:
            raise ReshardError(
                f"stage_layers {counts} add up to {sum(counts)} layers, the model has {num_layers}"
            )
        return tuple(stage for stage, n in enumerate(counts) for _ in range(n))

    @classmethod
    def coerce(cls, value: Parallelism | Mapping[str, Any], world_size: int | None = None) -> Parallelism:
        """A Parallelism from itself or a dict (``tp``/``pp``/``dp`` or NeMo/Megatron key names).

        ``dp`` may be left out when `world_size` is given; a given one must agree with it.
        """
        if isinstance(value, Parallelism):
            par = value
        elif isinstance(value, Mapping):
            sizes: dict[str, Any] = {}
            extra: dict[str, Any] = {}
            for key, v in value.items():
                axis = _ALIASES.get(str(key))
                if axis is not None:
                    if axis in sizes and sizes[axis] != v:
                        raise ReshardError(
                            f"parallelism gives {axis} twice with different values: {dict(value)}"
                        )
                    sizes[axis] = v
                elif key in ("order", "stage_layers"):
                    extra[str(key)] = v if key == "order" or v is None else tuple(v)
                else:
                    raise ReshardError(f"unknown parallelism key {key!r} (known: {sorted(_ALIASES)})")
            tp = _positive_int(sizes.get("tp", 1), "parallelism tp")
            pp = _positive_int(sizes.get("pp", 1), "parallelism pp")
            if "dp" not in sizes and world_size is not None:
                if world_size % (tp * pp):
                    raise ReshardError(f"world size {world_size} is not a multiple of tp*pp = {tp * pp}")
                sizes["dp"] = world_size // (tp * pp)
            par = cls(tp=tp, pp=pp, dp=sizes.get("dp", 1), **extra)
        else:
            raise ReshardError(f"parallelism must be a Parallelism or a dict, got {type(value).__name__}")
        if world_size is not None and par.world_size != world_size:
            raise ReshardError(
                f"parallelism tp={par.tp} x pp={par.pp} x dp={par.dp} = {par.world_size} ranks, "
                f"but the world size is {world_size}"
            )
        return par

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "order": self.order,
            "stage_layers": None if self.stage_layers is None else list(self.stage_layers),
        }


# -- parameters -------------------------------------------------------------------------------
@public
@dataclass(frozen=True)
class ParamSpec:
    """One parameter as the model defines it (full, unsharded shape) and how a side shards it.

    - ``tp_dim``: dimension split across tensor-parallel ranks, or None (replicated).
    - ``layer`` / ``stage``: pipeline ownership (see the module docstring).
    - ``parts``: ``((piece, size), ...)`` when the parameter is a concatenation of named pieces
      along ``fuse_dim`` (= ``tp_dim`` when split, else 0 unless given), each piece split across
      tensor-parallel ranks separately. Without parts the parameter is one piece named after
      itself. Pieces are what the two sides of a plan match by name.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    tp_dim: int | None = None
    layer: int | None = None
    stage: str = "first"
    parts: tuple[tuple[str, int], ...] | None = None
    fuse_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ReshardError(f"parameter name must be a non-empty string, got {self.name!r}")
        where = f"parameter {self.name!r}"
        try:
            shape = tuple(self.shape)
        except TypeError:
            raise ReshardError(
                f"{where}: shape must be a sequence of ints, got {self.shape!r}", self.name
            ) from None
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ReshardError(f"{where}: shape must hold non-negative ints, got {self.shape!r}", self.name)
        object.__setattr__(self, "shape", shape)
        if self.dtype not in DTYPE_SIZES:
            raise ReshardError(
                f"{where}: unknown dtype {self.dtype!r} (known: {sorted(DTYPE_SIZES)})", self.name
            )
        ndim = len(shape)
        if self.tp_dim is not None and (
            isinstance(self.tp_dim, bool) or not isinstance(self.tp_dim, int) or not 0 <= self.tp_dim < ndim
        ):
            raise ReshardError(
                f"{where}: tp_dim {self.tp_dim!r} is not a dimension of shape {shape}", self.name
            )
        if self.layer is not None and (
            isinstance(self.layer, bool) or not isinstance(self.layer, int) or self.layer < 0
        ):
            raise ReshardError(
                f"{where}: layer must be a non-negative int or None, got {self.layer!r}", self.name
            )
        if self.stage not in STAGES:
            raise ReshardError(f"{where}: stage must be one of {STAGES}, got {self.stage!r}", self.name)
        if self.fuse_dim is not None:
            if (
                isinstance(self.fuse_dim, bool)
                or not isinstance(self.fuse_dim, int)
                or not 0 <= self.fuse_dim < ndim
            ):
                raise ReshardError(
                    f"{where}: fuse_dim {self.fuse_dim!r} is not a dimension of shape {shape}", self.name
                )
            if self.tp_dim is not None and self.fuse_dim != self.tp_dim:
                raise ReshardError(
                    f"{where}: a split fused parameter concatenates its parts along tp_dim ({self.tp_dim}), "
                    f"not fuse_dim {self.fuse_dim}",
                    self.name,
                )
        if self.parts is not None:
            if ndim == 0:
                raise ReshardError(f"{where}: a scalar cannot be fused from parts", self.name)
            try:
                parts = tuple((str(p), s) for p, s in self.parts)
            except (TypeError, ValueError):
                raise ReshardError(
                    f"{where}: parts must be (piece name, size) pairs, got {self.parts!r}", self.name
                ) from None
            names = [p for p, _ in parts]
            if not parts or len(set(names)) != len(names) or not all(names):
                raise ReshardError(
                    f"{where}: parts need distinct non-empty piece names, got {names}", self.name
                )
            for piece, size in parts:
                if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                    raise ReshardError(f"{where}: part {piece!r} has invalid size {size!r}", self.name)
            dim = self.concat_dim
            if sum(s for _, s in parts) != shape[dim]:
                raise ReshardError(
                    f"{where}: parts {[s for _, s in parts]} add up to {sum(s for _, s in parts)}, "
                    f"but dimension {dim} has size {shape[dim]}",
                    self.name,
                )
            object.__setattr__(self, "parts", parts)

    @property
    def concat_dim(self) -> int:
        """The dimension along which parts are concatenated (and split, when split)."""
        if self.tp_dim is not None:
            return self.tp_dim
        return 0 if self.fuse_dim is None else self.fuse_dim

    @property
    def pieces(self) -> tuple[tuple[str, int], ...]:
        """``(piece, size along concat_dim)``; one piece named after the parameter if not fused."""
        if self.parts is not None:
            return self.parts
        return ((self.name, self.shape[self.concat_dim] if self.shape else 1),)

    def piece_shape(self, size: int) -> tuple[int, ...]:
        if not self.shape:
            return ()
        shape = list(self.shape)
        shape[self.concat_dim] = size
        return tuple(shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def local_shape(self, tp: int) -> tuple[int, ...]:
        """Shape of one tensor-parallel shard when the side has `tp` tensor-parallel ranks."""
        if self.tp_dim is None or tp == 1:
            return self.shape
        for piece, size in self.pieces:
            if size % tp:
                what = f"part {piece!r} (size {size})" if self.parts is not None else f"size {size}"
                raise ReshardError(
                    f"parameter {self.name!r}: {what} along dim {self.tp_dim} does not split "
                    f"into tp={tp} shards",
                    self.name,
                )
        shape = list(self.shape)
        shape[self.tp_dim] //= tp
        return tuple(shape)

    def stages(self, par: Parallelism, layer_stages: Sequence[int]) -> tuple[int, ...]:
        """Pipeline stages of `par` that hold this parameter."""
        if self.layer is not None:
            if self.layer >= len(layer_stages):
                raise ReshardError(
                    f"parameter {self.name!r}: layer {self.layer}, but the model has "
                    f"{len(layer_stages)} layers",
                    self.name,
                )
            return (layer_stages[self.layer],)
        last = par.pp - 1
        return {
            "first": (0,),
            "last": (last,),
            "first_and_last": tuple(sorted({0, last})),
            "all": tuple(range(par.pp)),
        }[self.stage]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "tp_dim": self.tp_dim,
            "layer": self.layer,
            "stage": self.stage,
            "parts": None if self.parts is None else [[p, s] for p, s in self.parts],
            "fuse_dim": self.fuse_dim,
        }

    @classmethod
    def coerce(cls, value: ParamSpec | Mapping[str, Any]) -> ParamSpec:
        if isinstance(value, ParamSpec):
            return value
        if not isinstance(value, Mapping):
            raise ReshardError(f"a parameter spec must be a ParamSpec or a dict, got {type(value).__name__}")
        known = {"name", "shape", "dtype", "tp_dim", "layer", "stage", "parts", "fuse_dim"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ReshardError(
                f"parameter spec {value.get('name')!r}: unknown keys {unknown}", value.get("name")
            )
        data = dict(value)
        if data.get("parts") is not None:
            data["parts"] = tuple(tuple(p) for p in data["parts"])
        if "shape" in data:
            data["shape"] = tuple(data["shape"])
        try:
            return cls(**data)
        except TypeError as exc:
            raise ReshardError(f"parameter spec {value.get('name')!r}: {exc}", value.get("name")) from None


@dataclass(frozen=True)
class Hold:
    """What one shard of a parameter holds of one piece: [start, stop) along ``dim`` of the piece,
    at ``offset`` along ``dim`` of the local tensor. ``dim`` None: the local tensor is the whole piece."""

    param: str
    piece: str
    dim: int | None
    start: int
    stop: int
    offset: int


def holds(spec: ParamSpec, tp: int, tp_rank: int) -> list[Hold]:
    spec.local_shape(tp)  # divisibility
    split = spec.tp_dim is not None and tp > 1
    if spec.parts is None and not split:
        extent = spec.shape[spec.concat_dim] if spec.shape else 1
        return [Hold(spec.name, spec.name, None, 0, extent, 0)]
    dim = spec.concat_dim
    holds, cursor = [], 0
    for piece, size in spec.pieces:
        if split:
            chunk = size // tp
            holds.append(Hold(spec.name, piece, dim, tp_rank * chunk, (tp_rank + 1) * chunk, cursor // tp))
        else:
            holds.append(Hold(spec.name, piece, dim, 0, size, cursor))
        cursor += size
    return holds
