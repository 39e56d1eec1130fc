"""Prefix-cache-aware routing: send a prompt where its longest prefix is probably cached."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, get_args

from typing_extensions import Unpack

from rlfleet.routing._index import HeapRouter
from rlfleet.routing._prefix_tree import Block, Cutter, Holdings, PrefixTree, Prompt
from rlfleet.routing._worker import RouterOptions, W, WorkerState, next_ticket, public_router

# What the router does with a worker's cached prefixes when the worker serves a new version.
OnNewVersion = Literal["forget", "keep"]
PREFIX_CACHE_ON_NEW_VERSION: tuple[OnNewVersion, ...] = get_args(OnNewVersion)

# A block held by more workers than this is a common prefix (a shared system prompt): it says
# little about where the prompt should go, so the choice falls back to least-load.
_SCAN_LIMIT = 32


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@public_router
class PrefixAwareRouter(HeapRouter[W]):
    """Route a prompt to the worker that most likely holds its longest prefix in its cache.

    Keys are prompts: a `str` (or `bytes`) or a sequence of token ids. The router keeps an
    approximate radix tree of the prompts each worker was sent, in blocks of `block_size`
    items (default 128 characters of text or bytes, 32 token ids), at most `max_blocks` blocks per
    worker (least recently used evicted first), so memory stays bounded. A prompt goes to the
    holder of its longest cached prefix that is under the load bound
    (`ceil(load_factor * (in_flight + 1) / candidates)`), the least loaded such holder first;
    when none is (no match, every holder over the bound, or a prefix so common that more than
    32 workers hold it) it goes to the least-loaded worker. A worker's blocks are forgotten
    when it leaves, and by default when it serves a new version (`on_new_version`).

    Versions and draining as in `Router`: with `prefer_newest_version=True` a cached prefix
    beats the version among workers within `version_lag` of the newest (a multi-turn session
    stays on its worker until that worker is updated); with "strict" only holders at the newest
    version count.

    Options of this router (keywords):
    - block_size=None: items per block (None: 128 characters or bytes of text, 32 token ids).
    - max_blocks=4096: blocks remembered per worker, about its KV cache size in blocks.
    - on_new_version='forget': what a worker's cached prefixes become when it serves a new
      version. 'forget': gone, for engines whose prefix cache is reset with new weights (the
      prefix is recomputed wherever it goes, so the session may move). 'keep': still routed
      to, for engines that keep their cache across weight versions (a session keeps its worker
      and reuses KV computed by the older weights: faster, slightly off-policy).
    """

    _sticky = True

    def __init__(
        self,
        workers: Iterable[W] = (),
        *,
        block_size: int | None = None,
        max_blocks: int = 4096,
        on_new_version: OnNewVersion = "forget",
        **options: Unpack[RouterOptions],
    ) -> None:
        if not isinstance(on_new_version, str) or on_new_version not in PREFIX_CACHE_ON_NEW_VERSION:
            raise ValueError(
                f"on_new_version must be one of {', '.join(map(repr, PREFIX_CACHE_ON_NEW_VERSION))}, "
                f"got {on_new_version!r}"
            )
        self._on_new_version: OnNewVersion = on_new_version
        text_block = 128 if block_size is None else _positive("block_size", block_size)
        self._cut = Cutter(text_block, 32 if block_size is None else text_block)
        self._tree: PrefixTree[W] = PrefixTree(_positive("max_blocks", max_blocks))
        super().__init__(workers, **options)

    # ------------------------------------------------------------------ hooks
    def _prepare(self, key: Any) -> Prompt | None:
        return None if key is None else self._cut(key)

    def _member_add(self, st: WorkerState[W]) -> None:
        st.slot = Holdings()

    def _member_remove(self, st: WorkerState[W]) -> None:
        self._tree.drop(st)

    def _version_changed(self, st: WorkerState[W]) -> None:
        if self._on_new_version == "forget":  # new weights invalidated its cache
            self._tree.drop(st)

    def _pick_in(self, key: Any, group: int | None, limit: int | None) -> WorkerState[W] | None:
        prompt: Prompt | None = key
        path = self._tree.walk(prompt.chunks) if prompt is not None else []
        bound = self._bound(group)
        st, held_to = self._best_holder(path, group, bound if limit is None or bound < limit else limit)
        if st is not None:
            st.load += 1  # its heap entry is now below its load: the heap pushes it again when met
        elif group is not None:
            st = self._heap.pop_min(group, limit)
        if st is None:
            return None
        st.picked = next_ticket()
        if prompt is not None:
            self._tree.insert(st, prompt.chunks, path, held_to)
        return st

    def _best_holder(
        self, path: list[Block], group: int | None, limit: int
    ) -> tuple[WorkerState[W] | None, int]:
        """The least-loaded eligible holder of the deepest block of `path` that has one, and how
        many blocks of `path` it holds (-1: none found)."""
        seen = -1
        floor = self._groups.floor
        for depth in range(len(path), 0, -1):
            holders = path[depth - 1].holders
            if len(holders) > _SCAN_LIMIT:
                break
            if len(holders) == seen:  # the same workers as the block below (prefix-closed)
                continue
            seen = len(holders)
            best: WorkerState[W] | None = None
            for st in holders:
                if (
                    st.selectable
                    and st.load < limit
                    and (st.group >= floor if group is None else st.group == group)
                    and (best is None or (st.load, st.picked) < (best.load, best.picked))
                ):
                    best = st
            if best is not None:
                return best, depth
        return None, -1

    # ------------------------------------------------------------------ inspection
    def match(self, prompt: Any) -> dict[W, int]:
        """Items of `prompt` each worker is believed to hold (block-aligned), longest first."""
        cut_prompt = self._prepare(prompt)
        if cut_prompt is None:
            return {}
        out: dict[W, int] = {}
        with self._lock:
            path = self._tree.walk(cut_prompt.chunks)
            for depth in range(len(path), 0, -1):
                for st in path[depth - 1].holders:
                    out.setdefault(st.key, depth * cut_prompt.block)
        return out

    @property
    def cached_blocks(self) -> dict[W, int]:
        """Blocks the tree believes each worker holds (each at most `max_blocks`)."""
        with self._lock:
            return {w: st.slot.count for w, st in self._states.items() if st.active}

    @property
    def tree_blocks(self) -> int:
        """Blocks in the shared tree: at most `max_blocks` times the number of workers."""
        with self._lock:
            return self._tree.blocks

    @property
    def on_new_version(self) -> OnNewVersion:
        """'forget' or 'keep': a worker's cached prefixes when it serves a new version."""
        return self._on_new_version

    @property
    def max_blocks(self) -> int:
        return self._tree.max_blocks

    @property
    def block_size(self) -> tuple[int, int]:
        """`(text block in characters or bytes, token block in token ids)`."""
        return self._cut.text_block, self._cut.token_block
