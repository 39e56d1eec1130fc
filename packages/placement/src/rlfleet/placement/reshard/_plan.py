"""Reshard plans as data: `Move`s (one training rank sends one slice to some generation ranks) and
`ReshardPlan` (all of them, validated, JSON round trip, one rank's program)."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rlfleet.placement._errors import ReshardError
from rlfleet.placement._public import public
from rlfleet.placement.reshard._specs import DTYPE_SIZES, Parallelism, ParamSpec

__all__ = ["RESHARD_FORMAT", "Move", "ReshardPlan", "describe_slice"]

RESHARD_FORMAT = 1


# -- moves and plans --------------------------------------------------------------------------
@public
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


def describe_slice(param: str, dim: int | None, start: int, stop: int) -> str:
    return (
        f"parameter {param!r} (whole)"
        if dim is None
        else f"parameter {param!r} [{start}:{stop}] along dim {dim}"
    )


@public
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
            self._check_source(m, train_local)
            for g in m.dsts:
                if not 0 <= g < self.gen.world_size:
                    raise ReshardError(
                        f"move of {m.dst_param!r} to generation rank {g}, outside the world", m.dst_param
                    )
                if m.dst_param not in gen_local[g]:
                    raise ReshardError(
                        f"generation rank {g} does not hold {m.dst_param!r}, yet receives "
                        f"{describe_slice(m.dst_param, m.dim, m.dst_offset, m.dst_offset + m.length)}",
                        m.dst_param,
                    )
                cover.setdefault((g, m.dst_param), []).append(
                    (m.dim, m.dst_offset, m.dst_offset + m.length, m)
                )
        for g in range(self.gen.world_size):
            for name, shape in gen_local[g].items():
                if math.prod(shape) > 0:
                    _check_covered(g, name, shape, cover.get((g, name), []))

    def _check_source(self, m: Move, train_local: Mapping[int, Mapping[str, tuple[int, ...]]]) -> None:
        """The sending rank exists, holds the source parameter and the slice."""
        if not 0 <= m.src < self.train.world_size:
            raise ReshardError(
                f"move of {m.dst_param!r} from training rank {m.src}, outside the world", m.dst_param
            )
        src_shape = train_local[m.src].get(m.src_param)
        if src_shape is None:
            raise ReshardError(
                f"training rank {m.src} does not hold {m.src_param!r}, yet sends "
                f"{describe_slice(m.dst_param, m.dim, m.start, m.stop)}",
                m.dst_param,
            )
        if m.stop <= m.start:
            raise ReshardError(
                f"empty move of {describe_slice(m.dst_param, m.dim, m.start, m.stop)}", m.dst_param
            )
        if m.dim is not None and (m.dim >= len(src_shape) or m.src_offset + m.length > src_shape[m.dim]):
            raise ReshardError(
                f"training rank {m.src}: {m.src_param!r} {src_shape} has no "
                f"[{m.src_offset}:{m.src_offset + m.length}] along dim {m.dim}",
                m.dst_param,
            )

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


def _check_covered(
    g: int, name: str, shape: tuple[int, ...], covers: list[tuple[int | None, int, int, Move]]
) -> None:
    """Generation rank ``g``'s shard of ``name`` is covered exactly once, along one dim."""
    pieces = sorted(covers, key=lambda c: (c[1], c[2]))
    dims = {c[0] for c in pieces}
    if not pieces:
        raise ReshardError(f"generation rank {g}: parameter {name!r} (whole) is not covered", name)
    if len(dims) > 1:
        raise ReshardError(
            f"generation rank {g}: parameter {name!r} is covered along several dims {sorted(map(str, dims))}",
            name,
        )
    dim = pieces[0][0]
    extent = 1 if dim is None else shape[dim]
    cursor = 0
    for _, lo, hi, move in pieces:
        if hi > extent:
            raise ReshardError(
                f"generation rank {g}: {describe_slice(name, dim, lo, hi)} is outside its shard "
                f"of size {extent}",
                name,
            )
        if lo < cursor:
            raise ReshardError(
                f"generation rank {g}: {describe_slice(name, dim, lo, min(hi, cursor))} "
                f"is covered twice (again by training rank {move.src})",
                name,
            )
        if lo > cursor:
            missing = describe_slice(name, dim, cursor, lo)
            raise ReshardError(f"generation rank {g}: {missing} is not covered", name)
        cursor = hi
    if cursor < extent:
        missing = describe_slice(name, dim, cursor, extent)
        raise ReshardError(f"generation rank {g}: {missing} is not covered", name)
