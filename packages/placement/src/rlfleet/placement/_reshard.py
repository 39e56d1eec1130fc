"""Resharding plans: which training rank sends which slice of which parameter to which generation ranks.

Training and generation usually shard a model differently (tensor, pipeline and data
parallelism of different sizes), and broadcasting the whole model to every generation rank
moves ``gen_tp`` times more bytes than a rank keeps. `plan_reshard` computes, as pure data,
the slices each generation rank needs and where to take them:

- every generation rank receives exactly its own shard, each destination element once;
- data-parallel (and tensor-replicated, and tied pipeline-stage) replicas of the same slice
  on the training side are interchangeable sources: each (slice, destination) unit goes to
  the least-loaded of them (largest units first), and a large slice is cut into chunks that
  different replicas send, so no rank is a funnel;
- fused parameters are data: a `ParamSpec` with ``parts`` is the concatenation of named
  pieces along its tensor-parallel dimension (or ``fuse_dim`` when replicated), each piece
  split across tensor-parallel ranks on its own (how Megatron and vLLM shard fused qkv and
  gate/up projections). Pieces are matched by name between the two sides, so "train keeps q,
  k, v separately, generation fuses them" and "both fuse them with different tp" are the same
  kind of input.

Rank convention (Megatron-LM's default order "tp-dp-pp"): tensor-parallel rank varies fastest,
then data-parallel, then pipeline stage, so ``rank = (pp_rank * dp + dp_rank) * tp + tp_rank``
and every pipeline stage is a contiguous block of ranks (one communication group per stage, as
NeMo RL's ``nccl_reshard`` forms them). Another order is a `Parallelism` field.

Pipeline ownership: a parameter with ``layer`` lives on the stage that owns that layer
(contiguous blocks of layers, as even as possible with earlier stages taking the remainder, or
``stage_layers`` given explicitly); one without a layer names its stage: ``"first"``
(embeddings), ``"last"`` (final norm, output head), ``"first_and_last"`` (tied embeddings) or
``"all"``.

A plan is deterministic (same input, same plan, same digest), JSON-safe (`to_dict` /
`from_dict`), and `validate` checks that every destination element is covered exactly once,
naming the parameter and the slice when it is not. `rank_program` cuts out what one process
needs to execute its part (rlfleet.weightsync's ``ReshardSender`` / ``ReshardReceiver``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rlfleet.placement._errors import PlacementError

__all__ = [
    "DEFAULT_STRIPE_BYTES",
    "DTYPE_SIZES",
    "RESHARD_FORMAT",
    "STAGES",
    "Move",
    "Parallelism",
    "ParamSpec",
    "ReshardError",
    "ReshardPlan",
    "plan_reshard",
]

RESHARD_FORMAT = 1
#: A slice at least this large, with several interchangeable sources, is cut into chunks that
#: different sources send.
DEFAULT_STRIPE_BYTES = 1 << 20
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


class ReshardError(PlacementError):
    """A reshard input or plan is inconsistent; the message names the parameter and slice."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReshardError(f"{what} must be a positive int, got {value!r}")
    return value


# -- layouts ----------------------------------------------------------------------------------
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
class _Hold:
    """What one shard of a parameter holds of one piece: [start, stop) along ``dim`` of the piece,
    at ``offset`` along ``dim`` of the local tensor. ``dim`` None: the local tensor is the whole piece."""

    param: str
    piece: str
    dim: int | None
    start: int
    stop: int
    offset: int


def _holds(spec: ParamSpec, tp: int, tp_rank: int) -> list[_Hold]:
    spec.local_shape(tp)  # divisibility
    split = spec.tp_dim is not None and tp > 1
    if spec.parts is None and not split:
        extent = spec.shape[spec.concat_dim] if spec.shape else 1
        return [_Hold(spec.name, spec.name, None, 0, extent, 0)]
    dim = spec.concat_dim
    holds, cursor = [], 0
    for piece, size in spec.pieces:
        if split:
            chunk = size // tp
            holds.append(_Hold(spec.name, piece, dim, tp_rank * chunk, (tp_rank + 1) * chunk, cursor // tp))
        else:
            holds.append(_Hold(spec.name, piece, dim, 0, size, cursor))
        cursor += size
    return holds


# -- moves and plans --------------------------------------------------------------------------
@dataclass(frozen=True)
class Move:
    """One training rank sends one slice to some generation ranks.

    The slice is ``[start, stop)`` along ``dim`` of ``piece`` (the logical, unsharded tensor);
    it sits at ``src_offset`` along ``dim`` in the sender's local ``src_param`` and lands at
    ``dst_offset`` in each receiver's local ``dst_param``; every other dimension is whole.
    ``dim`` None: a 0-d tensor, sent whole. ``nbytes`` is per destination.
    """

    dst_param: str
    piece: str
    dim: int | None
    start: int
    stop: int
    src: int
    src_param: str
    src_offset: int
    dst_offset: int
    dsts: tuple[int, ...]
    nbytes: int

    @property
    def length(self) -> int:
        return self.stop - self.start

    def to_list(self) -> list[Any]:
        return [
            self.dst_param,
            self.piece,
            self.dim,
            self.start,
            self.stop,
            self.src,
            self.src_param,
            self.src_offset,
            self.dst_offset,
            list(self.dsts),
            self.nbytes,
        ]

    @classmethod
    def from_list(cls, data: Any) -> Move:
        if not isinstance(data, (list, tuple)) or len(data) != 11:
            raise ReshardError(f"a move must be an 11-item list, got {data!r:.200}")
        dst_param, piece, dim, start, stop, src, src_param, src_offset, dst_offset, dsts, nbytes = data
        ints = (start, stop, src, src_offset, dst_offset, nbytes)
        if (
            not isinstance(dst_param, str)
            or not isinstance(piece, str)
            or not isinstance(src_param, str)
            or not (dim is None or (isinstance(dim, int) and not isinstance(dim, bool)))
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints)
            or not isinstance(dsts, (list, tuple))
            or not dsts
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dsts)
        ):
            raise ReshardError(f"malformed move {data!r:.200}")
        return cls(
            dst_param, piece, dim, start, stop, src, src_param, src_offset, dst_offset, tuple(dsts), nbytes
        )


def _describe_slice(param: str, dim: int | None, start: int, stop: int) -> str:
    return (
        f"parameter {param!r} (whole)"
        if dim is None
        else f"parameter {param!r} [{start}:{stop}] along dim {dim}"
    )


@dataclass(frozen=True)
class ReshardPlan:
    """Every move of one reshard, with the layouts and parameter specs it was planned from."""

    train: Parallelism
    gen: Parallelism
    train_params: tuple[ParamSpec, ...]
    gen_params: tuple[ParamSpec, ...]
    num_layers: int
    moves: tuple[Move, ...]

    # -- who holds what ---------------------------------------------------------------------
    def _side(self, side: str) -> tuple[Parallelism, tuple[ParamSpec, ...]]:
        if side == "train":
            return self.train, self.train_params
        if side == "gen":
            return self.gen, self.gen_params
        raise ReshardError(f"side must be 'train' or 'gen', got {side!r}")

    @cached_property
    def _layer_stages(self) -> dict[str, tuple[int, ...]]:
        return {
            "train": self.train.layer_stages(self.num_layers),
            "gen": self.gen.layer_stages(self.num_layers),
        }

    def local_params(self, side: str, rank: int) -> list[tuple[str, tuple[int, ...], str]]:
        """``(name, local shape, dtype)`` of every parameter shard `rank` of `side` holds, in spec order."""
        par, specs = self._side(side)
        _, pp_rank, _ = par.coords(rank)
        stages = self._layer_stages[side]
        return [
            (spec.name, spec.local_shape(par.tp), spec.dtype)
            for spec in specs
            if pp_rank in spec.stages(par, stages)
        ]

    def own_shard_bytes(self, gen_rank: int) -> int:
        """Bytes of the parameter shards generation rank `gen_rank` holds."""
        return sum(
            math.prod(shape) * DTYPE_SIZES[dtype] for _, shape, dtype in self.local_params("gen", gen_rank)
        )

    def sends(self, train_rank: int) -> list[Move]:
        return [m for m in self.moves if m.src == train_rank]

    def receives(self, gen_rank: int) -> list[Move]:
        return [m for m in self.moves if gen_rank in m.dsts]

    def bytes_sent(self) -> dict[int, int]:
        """Bytes each training rank sends (a move to k destinations counts k times)."""
        out = dict.fromkeys(range(self.train.world_size), 0)
        for m in self.moves:
            out[m.src] += m.nbytes * len(m.dsts)
        return out

    def bytes_received(self) -> dict[int, int]:
        """Bytes each generation rank receives."""
        out = dict.fromkeys(range(self.gen.world_size), 0)
        for m in self.moves:
            for d in m.dsts:
                out[d] += m.nbytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(m.nbytes * len(m.dsts) for m in self.moves)

    # -- checks -------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ReshardError unless every destination element is covered exactly once by a
        source that holds it; the message names the parameter, the slice and the rank."""
        gen_specs = {s.name: s for s in self.gen_params}
        train_specs = {s.name: s for s in self.train_params}
        train_local = {
            r: {n: shape for n, shape, _ in self.local_params("train", r)}
            for r in range(self.train.world_size)
        }
        gen_local = {
            g: {n: shape for n, shape, _ in self.local_params("gen", g)} for g in range(self.gen.world_size)
        }
        cover: dict[tuple[int, str], list[tuple[int | None, int, int, Move]]] = {}
        for m in self.moves:
            if m.dst_param not in gen_specs:
                raise ReshardError(f"move to unknown generation parameter {m.dst_param!r}", m.dst_param)
            if m.src_param not in train_specs:
                raise ReshardError(f"move from unknown training parameter {m.src_param!r}", m.dst_param)
            if not 0 <= m.src < self.train.world_size:
                raise ReshardError(
                    f"move of {m.dst_param!r} from training rank {m.src}, outside the world", m.dst_param
                )
            src_shape = train_local[m.src].get(m.src_param)
            if src_shape is None:
                raise ReshardError(
                    f"training rank {m.src} does not hold {m.src_param!r}, yet sends "
                    f"{_describe_slice(m.dst_param, m.dim, m.start, m.stop)}",
                    m.dst_param,
                )
            if m.stop <= m.start:
                raise ReshardError(
                    f"empty move of {_describe_slice(m.dst_param, m.dim, m.start, m.stop)}", m.dst_param
                )
            if m.dim is not None and (m.dim >= len(src_shape) or m.src_offset + m.length > src_shape[m.dim]):
                raise ReshardError(
                    f"training rank {m.src}: {m.src_param!r} {src_shape} has no "
                    f"[{m.src_offset}:{m.src_offset + m.length}] along dim {m.dim}",
                    m.dst_param,
                )
            for g in m.dsts:
                if not 0 <= g < self.gen.world_size:
                    raise ReshardError(
                        f"move of {m.dst_param!r} to generation rank {g}, outside the world", m.dst_param
                    )
                if m.dst_param not in gen_local[g]:
                    raise ReshardError(
                        f"generation rank {g} does not hold {m.dst_param!r}, yet receives "
                        f"{_describe_slice(m.dst_param, m.dim, m.dst_offset, m.dst_offset + m.length)}",
                        m.dst_param,
                    )
                cover.setdefault((g, m.dst_param), []).append(
                    (m.dim, m.dst_offset, m.dst_offset + m.length, m)
                )
        for g in range(self.gen.world_size):
            for name, shape in gen_local[g].items():
                if math.prod(shape) == 0:
                    continue
                pieces = sorted(cover.get((g, name), []), key=lambda c: (c[1], c[2]))
                dims = {c[0] for c in pieces}
                if not pieces:
                    raise ReshardError(
                        f"generation rank {g}: parameter {name!r} (whole) is not covered", name
                    )
                if len(dims) > 1:
                    raise ReshardError(
                        f"generation rank {g}: parameter {name!r} is covered along several dims "
                        f"{sorted(map(str, dims))}",
                        name,
                    )
                dim = pieces[0][0]
                extent = 1 if dim is None else shape[dim]
                cursor = 0
                for _, lo, hi, move in pieces:
                    if hi > extent:
                        raise ReshardError(
                            f"generation rank {g}: {_describe_slice(name, dim, lo, hi)} is outside its shard "
                            f"of size {extent}",
                            name,
                        )
                    if lo < cursor:
                        raise ReshardError(
                            f"generation rank {g}: {_describe_slice(name, dim, lo, min(hi, cursor))} "
                            f"is covered twice (again by training rank {move.src})",
                            name,
                        )
                    if lo > cursor:
                        raise ReshardError(
                            f"generation rank {g}: {_describe_slice(name, dim, cursor, lo)} is not covered",
                            name,
                        )
                    cursor = hi
                if cursor < extent:
                    raise ReshardError(
                        f"generation rank {g}: {_describe_slice(name, dim, cursor, extent)} is not covered",
                        name,
                    )
        extra = sorted({n for g, n in cover} - set(gen_specs))
        if extra:  # pragma: no cover - caught per move above
            raise ReshardError(f"moves to unknown parameters {extra}", extra[0])

    # -- serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form (the digest is checked on `from_dict`)."""
        body = self._body()
        body["digest"] = self.digest
        return body

    def _body(self) -> dict[str, Any]:
        return {
            "format": RESHARD_FORMAT,
            "train": self.train.to_dict(),
            "gen": self.gen.to_dict(),
            "num_layers": self.num_layers,
            "train_params": [s.to_dict() for s in self.train_params],
            "gen_params": [s.to_dict() for s in self.gen_params],
            "moves": [m.to_list() for m in self.moves],
        }

    @cached_property
    def digest(self) -> str:
        """sha256 of the canonical JSON of the plan: equal plans, equal digests."""
        return hashlib.sha256(json.dumps(self._body(), separators=(",", ":")).encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: Any) -> ReshardPlan:
        """Rebuild and validate a plan sent as JSON."""
        if not isinstance(data, Mapping) or data.get("format") != RESHARD_FORMAT:
            raise ReshardError(f"not a reshard plan of format {RESHARD_FORMAT}")
        try:
            plan = cls(
                train=Parallelism.coerce(data["train"]),
                gen=Parallelism.coerce(data["gen"]),
                train_params=tuple(ParamSpec.coerce(s) for s in data["train_params"]),
                gen_params=tuple(ParamSpec.coerce(s) for s in data["gen_params"]),
                num_layers=int(data["num_layers"]),
                moves=tuple(Move.from_list(m) for m in data["moves"]),
            )
        except (KeyError, TypeError) as exc:
            raise ReshardError(f"malformed reshard plan: {exc}") from None
        if "digest" in data and data["digest"] != plan.digest:
            raise ReshardError("reshard plan digest does not match its contents")
        plan.validate()
        return plan

    def rank_program(self, side: str, rank: int) -> dict[str, Any]:
        """What one process needs to execute its part, JSON-safe (rlfleet.weightsync reads it).

        ``tensors``: its local parameter shards ``[name, shape, dtype]``; ``transfers``: one
        entry per (move, destination) it takes part in:
        ``[src, dst, src_param, dst_param, dim, src_offset, dst_offset, length, nbytes, dtype]``.
        """
        par, specs = self._side(side)
        par.coords(rank)
        dtypes = {s.name: s.dtype for s in specs}
        transfers: list[list[Any]] = []
        for m in self.moves:
            dsts = (
                m.dsts
                if side == "train" and m.src == rank
                else (rank,)
                if side == "gen" and rank in m.dsts
                else ()
            )
            for d in dsts:
                transfers.append(
                    [
                        m.src,
                        d,
                        m.src_param,
                        m.dst_param,
                        m.dim,
                        m.src_offset,
                        m.dst_offset,
                        m.length,
                        m.nbytes,
                        dtypes[m.src_param if side == "train" else m.dst_param],
                    ]
                )
        return {
            "format": RESHARD_FORMAT,
            "digest": self.digest,
            "role": side,
            "rank": rank,
            "train_world_size": self.train.world_size,
            "gen_world_size": self.gen.world_size,
            "tensors": [[n, list(shape), dtype] for n, shape, dtype in self.local_params(side, rank)],
            "transfers": transfers,
        }

    def summary(self) -> dict[str, Any]:
        """Counts and byte totals, for logs and `prepare_nccl_reshard_refit_info`."""
        received = self.bytes_received()
        sent = self.bytes_sent()
        return {
            "digest": self.digest,
            "moves": len(self.moves),
            "total_bytes": self.total_bytes,
            "bytes_received": received,
            "bytes_sent": sent,
            "own_shard_bytes": {g: self.own_shard_bytes(g) for g in range(self.gen.world_size)},
            "senders": sum(1 for v in sent.values() if v),
        }


# -- planning ---------------------------------------------------------------------------------
@dataclass
class _Source:
    rank: int
    hold: _Hold


@dataclass
class _Unit:
    order: int
    dst: int
    dst_param: str
    piece: str
    dim: int | None
    start: int
    stop: int
    dst_offset: int
    nbytes: int
    candidates: list[_Source]


def _check_unique(specs: Sequence[ParamSpec], side: str) -> None:
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ReshardError(f"{side} parameter {s.name!r} is listed twice", s.name)
        seen.add(s.name)


def _piece_table(specs: Sequence[ParamSpec], side: str) -> dict[str, tuple[tuple[int, ...], str, ParamSpec]]:
    """piece -> (piece shape, dtype, first spec holding it); pieces listed twice must agree."""
    table: dict[str, tuple[tuple[int, ...], str, ParamSpec]] = {}
    for spec in specs:
        for piece, size in spec.pieces:
            shape = spec.piece_shape(size)
            known = table.get(piece)
            if known is None:
                table[piece] = (shape, spec.dtype, spec)
            elif known[:2] != (shape, spec.dtype):
                raise ReshardError(
                    f"{side} piece {piece!r} is {spec.dtype} {shape} in {spec.name!r} "
                    f"but {known[1]} {known[0]} in {known[2].name!r}",
                    spec.name,
                )
    return table


def plan_reshard(
    params: Iterable[ParamSpec | Mapping[str, Any]],
    train: Parallelism | Mapping[str, Any],
    gen: Parallelism | Mapping[str, Any],
    *,
    gen_params: Iterable[ParamSpec | Mapping[str, Any]] | None = None,
    num_layers: int | None = None,
    train_world_size: int | None = None,
    gen_world_size: int | None = None,
    stripe_bytes: int = DEFAULT_STRIPE_BYTES,
) -> ReshardPlan:
    """Plan moving `params` from the `train` layout to the `gen` layout.

    `params` are the training side's parameters; `gen_params` the generation side's (same as
    `params` when None; give them to rename or fuse differently: pieces match by name).
    `num_layers` defaults to one more than the largest ``layer`` of any spec. Raises
    ReshardError naming the parameter and slice when a destination cannot be covered.
    """
    train_par = Parallelism.coerce(train, train_world_size)
    gen_par = Parallelism.coerce(gen, gen_world_size)
    train_specs = tuple(ParamSpec.coerce(s) for s in params)
    gen_specs = train_specs if gen_params is None else tuple(ParamSpec.coerce(s) for s in gen_params)
    if isinstance(stripe_bytes, bool) or not isinstance(stripe_bytes, int) or stripe_bytes < 1:
        raise ReshardError(f"stripe_bytes must be a positive int, got {stripe_bytes!r}")
    _check_unique(train_specs, "training")
    _check_unique(gen_specs, "generation")
    layers = [s.layer for s in (*train_specs, *gen_specs) if s.layer is not None]
    if num_layers is None:
        num_layers = max(layers, default=-1) + 1
    elif isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ReshardError(f"num_layers must be a non-negative int, got {num_layers!r}")
    train_stages = train_par.layer_stages(num_layers)
    gen_stages = gen_par.layer_stages(num_layers)
    train_pieces = _piece_table(train_specs, "training")
    gen_pieces = _piece_table(gen_specs, "generation")
    for piece, (shape, dtype, spec) in gen_pieces.items():
        theirs = train_pieces.get(piece)
        if theirs is None:
            raise ReshardError(
                f"generation parameter {spec.name!r} needs piece {piece!r}, which no training parameter has",
                spec.name,
            )
        if theirs[:2] != (shape, dtype):
            raise ReshardError(
                f"generation parameter {spec.name!r}: piece {piece!r} is {dtype} {shape} there, "
                f"but {theirs[1]} {theirs[0]} in training parameter {theirs[2].name!r} "
                "(no casts or reshapes in flight)",
                spec.name,
            )

    # Every training shard of every piece, with the ranks (replicas) that hold it.
    sources: dict[str, list[tuple[_Hold, tuple[int, ...]]]] = {}
    for spec in train_specs:
        stages = spec.stages(train_par, train_stages)
        for tp_rank in range(train_par.tp):
            replicas = tuple(
                sorted(train_par.rank(tp=tp_rank, pp=s, dp=d) for s in stages for d in range(train_par.dp))
            )
            for hold in _holds(spec, train_par.tp, tp_rank):
                sources.setdefault(hold.piece, []).append((hold, replicas))
    # Replicated shards hold the same thing on every tp rank: merge them into one source set.
    merged: dict[str, list[tuple[_Hold, tuple[int, ...]]]] = {}
    for piece, entries in sources.items():
        by_hold: dict[_Hold, set[int]] = {}
        for hold, ranks in entries:
            by_hold.setdefault(hold, set()).update(ranks)
        merged[piece] = [(h, tuple(sorted(r))) for h, r in by_hold.items()]

    units: list[_Unit] = []
    for spec in gen_specs:
        stages = spec.stages(gen_par, gen_stages)
        for tp_rank in range(gen_par.tp):
            dsts = sorted(gen_par.rank(tp=tp_rank, pp=s, dp=d) for s in stages for d in range(gen_par.dp))
            for hold in _holds(spec, gen_par.tp, tp_rank):
                units.extend(
                    _units_for(
                        spec,
                        hold,
                        dsts,
                        merged[hold.piece],
                        gen_pieces[hold.piece][0],
                        stripe_bytes,
                        len(units),
                    )
                )

    # Least-loaded source for each unit, largest units first (deterministic ties: lowest rank).
    load = dict.fromkeys(range(train_par.world_size), 0)
    grouped: dict[tuple[Any, ...], list[int]] = {}
    for unit in sorted(units, key=lambda u: (-u.nbytes, u.order)):
        best = min(unit.candidates, key=lambda c: (load[c.rank], c.rank))
        load[best.rank] += unit.nbytes
        h = best.hold
        src_offset = unit.start if h.dim is None else h.offset + unit.start - h.start
        key = (
            unit.dst_param,
            unit.piece,
            unit.dim,
            unit.start,
            unit.stop,
            best.rank,
            h.param,
            src_offset,
            unit.dst_offset,
            unit.nbytes,
        )
        grouped.setdefault(key, []).append(unit.dst)
    order = {s.name: i for i, s in enumerate(gen_specs)}
    moves = tuple(
        Move(k[0], k[1], k[2], k[3], k[4], k[5], k[6], k[7], k[8], tuple(sorted(dsts)), k[9])
        for k, dsts in sorted(
            grouped.items(), key=lambda kv: (order[kv[0][0]], kv[0][8], kv[0][5], kv[0][1:])
        )
    )
    plan = ReshardPlan(train_par, gen_par, train_specs, gen_specs, num_layers, moves)
    plan.validate()
    return plan


def _units_for(
    spec: ParamSpec,
    hold: _Hold,
    dsts: Sequence[int],
    sources: Sequence[tuple[_Hold, tuple[int, ...]]],
    piece_shape: tuple[int, ...],
    stripe_bytes: int,
    order: int,
) -> list[_Unit]:
    """The (slice, destination) units one destination hold needs, each with its candidate sources."""
    dims = {hold.dim} | {h.dim for h, _ in sources if _intersects(h, hold)}
    dims.discard(None)
    if len(dims) > 1:
        raise ReshardError(
            f"generation parameter {spec.name!r}: piece {hold.piece!r} is split or fused along dims "
            f"{sorted(d for d in dims if d is not None)} on the two sides; a slice can only follow one dim",
            spec.name,
        )
    dim: int | None = dims.pop() if dims else (0 if piece_shape else None)
    extent = 1 if dim is None else piece_shape[dim]
    row = math.prod(piece_shape) // extent if extent else 0
    itemsize = DTYPE_SIZES[spec.dtype]

    def span(h: _Hold) -> tuple[int, int]:
        return (h.start, h.stop) if h.dim is not None else (0, extent)

    lo, hi = span(hold)
    covering = [(h, ranks) for h, ranks in sources if span(h)[0] < hi and span(h)[1] > lo]
    cuts = sorted({lo, hi} | {c for h, _ in covering for c in span(h) if lo < c < hi})
    units: list[_Unit] = []
    segments: list[tuple[int, int, list[_Source]]] = []
    for a, b in itertools.pairwise(cuts):
        cands = [
            _Source(rank, h) for h, ranks in covering if span(h)[0] <= a and span(h)[1] >= b for rank in ranks
        ]
        if not cands:
            raise ReshardError(
                f"no training rank holds {_describe_slice(spec.name, dim, a, b)} (piece {hold.piece!r}), "
                f"needed by generation rank(s) {list(dsts)}",
                spec.name,
            )
        unique: list[_Source] = []
        for cand in sorted(cands, key=lambda c: c.rank):
            if not unique or unique[-1].rank != cand.rank:
                unique.append(cand)
        key = sorted((c.rank, c.hold.param) for c in unique)
        if (
            segments
            and segments[-1][1] == a
            and sorted((c.rank, c.hold.param) for c in segments[-1][2]) == key
        ):
            segments[-1] = (segments[-1][0], b, segments[-1][2])
        else:
            segments.append((a, b, unique))
    for a, b, cands in segments:
        if a == b or row == 0:
            continue
        nbytes = (b - a) * row * itemsize
        chunks = 1
        if dim is not None and len(cands) > 1 and nbytes >= stripe_bytes:
            chunks = max(1, min(len(cands), b - a, nbytes // stripe_bytes))
        bounds = [a + (b - a) * i // chunks for i in range(chunks + 1)]
        for c0, c1 in itertools.pairwise(bounds):
            if c0 == c1:
                continue
            dst_offset = c0 if hold.dim is None else hold.offset + c0 - hold.start
            for d in dsts:
                units.append(
                    _Unit(
                        order + len(units),
                        d,
                        spec.name,
                        hold.piece,
                        dim,
                        c0,
                        c1,
                        dst_offset,
                        (c1 - c0) * row * itemsize,
                        cands,
                    )
                )
    return units


def _intersects(a: _Hold, b: _Hold) -> bool:
    if a.dim is None or b.dim is None or a.dim != b.dim:
        return True
    return a.start < b.stop and b.start < a.stop
