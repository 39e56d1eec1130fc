"""Transforms between the trainer's weights and what an engine's ``load_weights`` expects.

A trainer names, splits and types its parameters its own way (``model.layers.0.self_attn.q_proj``
in float32); an inference engine wants its own names, stacked projections (one ``qkv_proj``
where the trainer has ``q_proj``, ``k_proj``, ``v_proj``) and its serving dtype. These stages
sit between the two ends and work on a stream of ``(name, tensor)`` pairs, so a receiver applies
them bucket by bucket, as buckets land, without ever materialising the whole model:

- `Rename`: an exact map, a prefix swap or a regex substitution;
- `Fuse`: stacks shards into one parameter the way vLLM's Llama ``load_weights`` reads its
  ``stacked_params_mapping`` (``("qkv_proj", "q_proj", "q")``: a name containing ``q_proj``
  becomes the ``qkv_proj`` name, and the shards are concatenated along the output dimension
  in the order the mapping lists them);
- `Cast`: floating tensors to the serving dtype;
- `Drop`: weights the engine does not take.

Every stage is push-based (`feed` one pair, get zero or more pairs out; `finish` at the end of
a version), so a stage that must wait for several shards holds only those. `plan_transforms`
runs the same code on meta tensors: the names, shapes and dtypes a chain produces are known
(and checked) before a byte moves.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from rlfleet.weightsync._errors import LayoutMismatchError
from rlfleet.weightsync.layout._dtypes import dtype_from_name, dtype_name

__all__ = [
    "LLAMA_STACKED_PARAMS",
    "Cast",
    "Drop",
    "Fuse",
    "Rename",
    "TransformChain",
    "WeightTransform",
    "apply_transforms",
    "plan_transforms",
]

Weight = tuple[str, torch.Tensor]

#: vLLM's Llama ``stacked_params_mapping``: (stacked parameter, shard name, shard id).
LLAMA_STACKED_PARAMS: tuple[tuple[str, str, str | int], ...] = (
    (".qkv_proj", ".q_proj", "q"),
    (".qkv_proj", ".k_proj", "k"),
    (".qkv_proj", ".v_proj", "v"),
    (".gate_up_proj", ".gate_proj", 0),
    (".gate_up_proj", ".up_proj", 1),
)


class WeightTransform:
    """One stage of a chain: `start` a version, `feed` pairs, `finish` the version.

    The default stage passes every pair through unchanged; subclasses override `feed` (and
    `finish` if they hold pairs back). A tensor handed to `feed` may be a view of a buffer that
    is reused after the call: a stage that keeps it must copy it.
    """

    def start(self) -> None:
        """Forget everything of the previous version (also after an aborted one)."""

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        yield name, tensor

    def finish(self) -> Iterator[Weight]:
        """Pairs held back until the end of the version; raises if the version is incomplete."""
        return iter(())


class TransformChain(WeightTransform):
    """Stages applied in order: what one stage yields is fed to the next."""

    def __init__(self, stages: Iterable[WeightTransform]) -> None:
        self.stages: tuple[WeightTransform, ...] = tuple(stages)
        for stage in self.stages:
            if not isinstance(stage, WeightTransform):
                raise TypeError(f"a transform stage must be a WeightTransform, got {type(stage).__name__}")

    def start(self) -> None:
        for stage in self.stages:
            stage.start()

    def _through(self, first: int, pairs: Iterable[Weight]) -> Iterator[Weight]:
        if first == len(self.stages):
            yield from pairs
            return
        stage = self.stages[first]
        for name, tensor in pairs:
            yield from self._through(first + 1, stage.feed(name, tensor))

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        return self._through(0, ((name, tensor),))

    def finish(self) -> Iterator[Weight]:
        for index, stage in enumerate(self.stages):
            yield from self._through(index + 1, stage.finish())


def _chain(transforms: WeightTransform | Sequence[WeightTransform]) -> WeightTransform:
    return transforms if isinstance(transforms, WeightTransform) else TransformChain(transforms)


def apply_transforms(
    transforms: WeightTransform | Sequence[WeightTransform], weights: Iterable[Weight]
) -> Iterator[Weight]:
    """The pairs `weights` become through `transforms`, as one version (lazily, in order)."""
    chain = _chain(transforms)
    chain.start()
    for name, tensor in weights:
        yield from chain.feed(name, tensor)
    yield from chain.finish()


def plan_transforms(
    transforms: WeightTransform | Sequence[WeightTransform],
    entries: Iterable[tuple[str, Sequence[int], str | torch.dtype]],
) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of what `transforms` make of `entries`, computed on meta tensors.

    Raises what the transforms would raise on real tensors (a shard without its siblings, a
    shape that cannot stack, two names renamed to one) before any byte moves.
    """
    metas = (
        (name, torch.empty(tuple(shape), dtype=_as_dtype(dtype), device="meta"))
        for name, shape, dtype in entries
    )
    return [
        (name, tuple(tensor.shape), dtype_name(tensor.dtype))
        for name, tensor in apply_transforms(transforms, metas)
    ]


def _as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else dtype_from_name(dtype)


class Rename(WeightTransform):
    """Renames each weight with `rename(name)`; two weights renamed to one name is an error.

    Build it with `Rename.exact`, `Rename.prefix` or `Rename.regex`, or give any function.
    """

    def __init__(self, rename: Callable[[str], str], description: str = "rename") -> None:
        self.rename = rename
        self.description = description
        self._seen: dict[str, str] = {}

    @classmethod
    def exact(cls, mapping: Mapping[str, str], *, strict: bool = False) -> Rename:
        """Names in `mapping` take their new name; others pass unchanged (or, `strict`, fail)."""
        table = dict(mapping)

        def rename(name: str) -> str:
            new = table.get(name)
            if new is not None:
                return new
            if strict:
                raise LayoutMismatchError(f"weight {name!r} is not in the rename map", name)
            return name

        return cls(rename, f"rename map of {len(table)} names")

    @classmethod
    def prefix(cls, old: str, new: str, *, strict: bool = False) -> Rename:
        """``old + rest`` becomes ``new + rest``; names without `old` pass (or, `strict`, fail)."""

        def rename(name: str) -> str:
            if name.startswith(old):
                return new + name[len(old) :]
            if strict:
                raise LayoutMismatchError(f"weight {name!r} does not start with {old!r}", name)
            return name

        return cls(rename, f"prefix {old!r} -> {new!r}")

    @classmethod
    def regex(cls, pattern: str, replacement: str, *, count: int = 0) -> Rename:
        """`re.sub(pattern, replacement, name)` (backreferences allowed)."""
        compiled = re.compile(pattern)
        return cls(lambda name: compiled.sub(replacement, name, count=count), f"regex {pattern!r}")

    def start(self) -> None:
        self._seen = {}

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        new = self.rename(name)
        if not isinstance(new, str) or not new:
            raise LayoutMismatchError(f"{self.description} turned {name!r} into {new!r}", name)
        before = self._seen.get(new)
        if before is not None:
            raise LayoutMismatchError(
                f"{self.description} renames both {before!r} and {name!r} to {new!r}", name
            )
        self._seen[new] = name
        yield new, tensor


class Fuse(WeightTransform):
    """Stacks shards into one parameter, as vLLM's ``stacked_params_mapping`` describes it.

    `mapping` holds ``(stacked, shard, shard_id)`` triples: a weight whose name contains
    `shard` is a piece of the weight named with `stacked` in its place; once every shard id
    listed for `stacked` has arrived, the pieces are concatenated along `dim` in the order
    the mapping lists them (q, k, v; gate, up) and the stacked weight is yielded. Pieces must
    agree in dtype and in every other dimension. A version that ends with pieces missing
    raises, naming the stacked weight and the missing shards.
    """

    def __init__(self, mapping: Iterable[tuple[str, str, str | int]] = LLAMA_STACKED_PARAMS, dim: int = 0):
        self.mapping = tuple(mapping)
        if not self.mapping:
            raise ValueError("Fuse needs at least one (stacked, shard, shard_id) triple")
        self.dim = dim
        self._order: dict[str, list[str | int]] = {}
        for stacked, shard, shard_id in self.mapping:
            if not stacked or not shard or stacked == shard:
                raise ValueError(f"Fuse: invalid triple {(stacked, shard, shard_id)!r}")
            ids = self._order.setdefault(stacked, [])
            if shard_id in ids:
                raise ValueError(f"Fuse: shard id {shard_id!r} listed twice for {stacked!r}")
            ids.append(shard_id)
        #: stacked weight name -> (its stacked key, the shards that arrived, by shard id)
        self._pending: dict[str, tuple[str, dict[str | int, Weight]]] = {}

    def start(self) -> None:
        self._pending = {}

    def _match(self, name: str) -> tuple[str, str, str | int] | None:
        for stacked, shard, shard_id in self.mapping:
            if shard in name:
                return stacked, name.replace(shard, stacked), shard_id
        return None

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        match = self._match(name)
        if match is None:
            yield name, tensor
            return
        stacked, target, shard_id = match
        pieces = self._pending.setdefault(target, (stacked, {}))[1]
        if shard_id in pieces:
            raise LayoutMismatchError(
                f"shard {shard_id!r} of {target!r} arrived twice ({pieces[shard_id][0]!r} and {name!r})", name
            )
        if pieces:
            self._check_piece(target, next(iter(pieces.values())), (name, tensor))
        order = self._order[stacked]
        if len(pieces) + 1 < len(order):
            pieces[shard_id] = (name, tensor if tensor.is_meta else tensor.detach().clone())
            return
        pieces[shard_id] = (name, tensor)
        del self._pending[target]
        yield target, torch.cat([pieces[i][1] for i in order], dim=self.dim)

    def _check_piece(self, target: str, first: Weight, other: Weight) -> None:
        (a_name, a), (b_name, b) = first, other
        if a.dtype != b.dtype:
            raise LayoutMismatchError(
                f"cannot stack {target!r}: {a_name!r} is {dtype_name(a.dtype)}, "
                f"{b_name!r} is {dtype_name(b.dtype)}",
                b_name,
            )
        dim = self.dim % max(a.dim(), 1)
        if a.dim() != b.dim() or any(
            x != y for i, (x, y) in enumerate(zip(a.shape, b.shape, strict=True)) if i != dim
        ):
            raise LayoutMismatchError(
                f"cannot stack {target!r} along dim {self.dim}: {a_name!r} is {tuple(a.shape)}, "
                f"{b_name!r} is {tuple(b.shape)}",
                b_name,
            )

    def finish(self) -> Iterator[Weight]:
        if self._pending:
            others = len(self._pending) - 1
            target, (stacked, pieces) = next(iter(self._pending.items()))
            missing = [i for i in self._order[stacked] if i not in pieces]
            have = sorted(name for name, _ in pieces.values())
            self._pending = {}
            raise LayoutMismatchError(
                f"stacked weight {target!r} is missing shard(s) {missing} (got {have}); "
                f"{others} other stacked weight(s) incomplete",
                target,
            )
        return iter(())


class Cast(WeightTransform):
    """Casts floating-point weights to `dtype` (integer and boolean tensors pass unchanged).

    `only`: a regex; when given, only names it matches (``re.search``) are cast.
    """

    def __init__(self, dtype: torch.dtype | str, *, only: str | None = None) -> None:
        self.dtype = _as_dtype(dtype)
        if not self.dtype.is_floating_point:
            raise ValueError(f"Cast: target dtype must be floating point, got {self.dtype}")
        self.only = re.compile(only) if only is not None else None

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        if (
            tensor.dtype == self.dtype
            or not tensor.dtype.is_floating_point
            or (self.only is not None and not self.only.search(name))
        ):
            yield name, tensor
            return
        yield name, tensor.to(self.dtype)


class Drop(WeightTransform):
    """Leaves out weights whose name matches the regex `pattern` (``re.search``)."""

    def __init__(self, pattern: str) -> None:
        self.pattern = re.compile(pattern)

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[Weight]:
        if not self.pattern.search(name):
            yield name, tensor
