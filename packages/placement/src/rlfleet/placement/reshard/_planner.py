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

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlfleet.placement._errors import ReshardError
from rlfleet.placement._public import public
from rlfleet.placement.reshard._plan import Move, ReshardPlan, describe_slice
from rlfleet.placement.reshard._specs import DTYPE_SIZES, Hold, Parallelism, ParamSpec, holds

__all__ = ["DEFAULT_STRIPE_BYTES", "plan_reshard"]

#: A slice at least this large, with several interchangeable sources, is cut into chunks that
#: different sources send.
DEFAULT_STRIPE_BYTES = 1 << 20


# -- planning ---------------------------------------------------------------------------------
@dataclass
class _Source:
    rank: int
    hold: Hold


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


@public
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
    gen_stages = gen_par.layer_stages(num_layers)
    train_pieces = _piece_table(train_specs, "training")
    gen_pieces = _piece_table(gen_specs, "generation")
    _check_pieces_match(train_pieces, gen_pieces)
    merged = _sources(train_specs, train_par, train_par.layer_stages(num_layers))
    units: list[_Unit] = []
    for spec in gen_specs:
        stages = spec.stages(gen_par, gen_stages)
        for tp_rank in range(gen_par.tp):
            dsts = sorted(gen_par.rank(tp=tp_rank, pp=s, dp=d) for s in stages for d in range(gen_par.dp))
            for hold in holds(spec, gen_par.tp, tp_rank):
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

    moves = _assign(units, train_par.world_size, gen_specs)
    plan = ReshardPlan(train_par, gen_par, train_specs, gen_specs, num_layers, moves)
    plan.validate()
    return plan


def _check_pieces_match(
    train_pieces: Mapping[str, tuple[tuple[int, ...], str, ParamSpec]],
    gen_pieces: Mapping[str, tuple[tuple[int, ...], str, ParamSpec]],
) -> None:
    """Every piece the generation side needs exists on the training side, same dtype and shape."""
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


def _sources(
    train_specs: Sequence[ParamSpec], train_par: Parallelism, train_stages: Sequence[int]
) -> dict[str, list[tuple[Hold, tuple[int, ...]]]]:
    """Every training shard of every piece, with the ranks (replicas) that hold it."""
    sources: dict[str, list[tuple[Hold, tuple[int, ...]]]] = {}
    for spec in train_specs:
        stages = spec.stages(train_par, train_stages)
        for tp_rank in range(train_par.tp):
            replicas = tuple(
                sorted(train_par.rank(tp=tp_rank, pp=s, dp=d) for s in stages for d in range(train_par.dp))
            )
            for hold in holds(spec, train_par.tp, tp_rank):
                sources.setdefault(hold.piece, []).append((hold, replicas))
    # Replicated shards hold the same thing on every tp rank: merge them into one source set.
    merged: dict[str, list[tuple[Hold, tuple[int, ...]]]] = {}
    for piece, entries in sources.items():
        by_hold: dict[Hold, set[int]] = {}
        for hold, ranks in entries:
            by_hold.setdefault(hold, set()).update(ranks)
        merged[piece] = [(h, tuple(sorted(r))) for h, r in by_hold.items()]
    return merged


def _assign(units: Sequence[_Unit], world_size: int, gen_specs: Sequence[ParamSpec]) -> tuple[Move, ...]:
    """Least-loaded source for each unit, largest units first (deterministic ties: lowest rank)."""
    load = dict.fromkeys(range(world_size), 0)
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
    return moves


def _units_for(
    spec: ParamSpec,
    hold: Hold,
    dsts: Sequence[int],
    sources: Sequence[tuple[Hold, tuple[int, ...]]],
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

    def span(h: Hold) -> tuple[int, int]:
        return (h.start, h.stop) if h.dim is not None else (0, extent)

    lo, hi = span(hold)
    covering = [(h, ranks) for h, ranks in sources if span(h)[0] < hi and span(h)[1] > lo]
    units: list[_Unit] = []
    segments = _segments(spec, hold, dim, covering, span, dsts)
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


def _segments(
    spec: ParamSpec,
    hold: Hold,
    dim: int | None,
    covering: Sequence[tuple[Hold, tuple[int, ...]]],
    span: Callable[[Hold], tuple[int, int]],
    dsts: Sequence[int],
) -> list[tuple[int, int, list[_Source]]]:
    """The destination hold cut where its sources change, each run with its candidate sources."""
    lo, hi = span(hold)
    cuts = sorted({lo, hi} | {c for h, _ in covering for c in span(h) if lo < c < hi})
    segments: list[tuple[int, int, list[_Source]]] = []
    for a, b in itertools.pairwise(cuts):
        cands = [
            _Source(rank, h) for h, ranks in covering if span(h)[0] <= a and span(h)[1] >= b for rank in ranks
        ]
        if not cands:
            raise ReshardError(
                f"no training rank holds {describe_slice(spec.name, dim, a, b)} (piece {hold.piece!r}), "
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
    return segments


def _intersects(a: Hold, b: Hold) -> bool:
    if a.dim is None or b.dim is None or a.dim != b.dim:
        return True
    return a.start < b.stop and b.start < a.stop
