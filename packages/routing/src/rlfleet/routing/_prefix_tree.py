"""An approximate radix tree of the prompt prefixes each worker has served, with per-worker LRU.

A prompt (text or token ids) is cut into fixed-size blocks; a tree node is one block after the
blocks above it, so two prompts share nodes exactly as long as they share a block-aligned
prefix. Each node records which workers hold it and when they last used it. The tree stands
for the workers' prefix (KV) caches without asking them: it is approximate (block granularity,
a capacity guessed by the caller, no eviction signal from the workers).

Per worker the held blocks are prefix-closed (a worker holding a block holds its parent) and
an ancestor is always used at least as recently as its descendants, so evicting in stamp order
removes leaves first. Eviction works from a FIFO of `(stamp, deepest block)` entries, one per
insert; an entry is live while its block still carries its stamp. Memory is bounded: a worker
holds at most `max_blocks` blocks and its FIFO at most twice its live entries plus a constant.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from typing import Any, Generic

from rlfleet.routing._worker import W, WorkerState, next_ticket

_QUEUE_SLACK = 32


class Block:
    """One block of some served prompt, shared by every worker that holds it."""

    __slots__ = ("children", "chunk", "holders", "parent")

    def __init__(self, chunk: Hashable, parent: Block | None) -> None:
        self.chunk = chunk
        self.parent = parent
        self.children: dict[Hashable, Block] = {}
        self.holders: dict[Any, int] = {}  # worker state -> stamp of its last use


class Holdings:
    """What the tree believes one worker caches: a count and its eviction FIFO."""

    __slots__ = ("count", "queue")

    def __init__(self) -> None:
        self.count = 0
        self.queue: deque[tuple[int, Block]] = deque()


class Prompt:
    """A request's prompt cut into blocks (done once, outside the router's lock)."""

    __slots__ = ("block", "chunks", "size")

    def __init__(self, chunks: list[Hashable], size: int, block: int) -> None:
        self.chunks = chunks
        self.size = size  # items (characters, bytes or tokens)
        self.block = block  # items per block

    def __repr__(self) -> str:
        return f"<prompt of {self.size} items, {len(self.chunks)} blocks>"


class Cutter:
    """Cuts prompts (str, bytes or sequences of token ids) into full blocks; a tail is dropped.

    The slices of the first `_CUTS` blocks are made once, so cutting runs in C (`map`).
    """

    _CUTS = 1024

    __slots__ = ("text_block", "text_cuts", "token_block", "token_cuts")

    def __init__(self, text_block: int, token_block: int) -> None:
        self.text_block = text_block
        self.token_block = token_block
        self.text_cuts = [slice(i * text_block, (i + 1) * text_block) for i in range(self._CUTS)]
        self.token_cuts = [slice(i * token_block, (i + 1) * token_block) for i in range(self._CUTS)]

    def __call__(self, prompt: object) -> Prompt:
        if isinstance(prompt, (str, bytes)):
            b, cuts = self.text_block, self.text_cuts
            whole = True
        elif isinstance(prompt, Sequence):
            b, cuts = self.token_block, self.token_cuts
            whole = False
        else:
            kind = type(prompt).__name__
            raise TypeError(
                f"a prefix-aware key is a prompt: a str, bytes or a sequence of token ids, got {kind}"
            )
        n = len(prompt) // b
        if n > self._CUTS:
            cuts = [slice(i * b, (i + 1) * b) for i in range(n)]
        pieces = map(prompt.__getitem__, cuts[:n])
        chunks: list[Hashable] = list(pieces) if whole else list(map(tuple, pieces))
        return Prompt(chunks, len(prompt), b)


class PrefixTree(Generic[W]):
    """The shared tree. Not thread-safe: the router's lock guards it."""

    __slots__ = ("blocks", "max_blocks", "root")

    def __init__(self, max_blocks: int) -> None:
        self.root = Block(None, None)
        self.max_blocks = max_blocks  # per worker
        self.blocks = 0  # nodes in the tree (the root aside)

    def walk(self, chunks: list[Hashable]) -> list[Block]:
        """The blocks of the longest prefix of `chunks` someone holds, root side first."""
        path: list[Block] = []
        append = path.append
        children = self.root.children
        for chunk in chunks:
            node = children.get(chunk)
            if node is None:
                break
            append(node)
            children = node.children
        return path

    def insert(
        self, st: WorkerState[W], chunks: list[Hashable], path: list[Block], held_to: int = -1
    ) -> None:
        """`st` now caches every block of `chunks` (`path`: what `walk` found; `held_to`: how many
        of them `st` holds, if known); evict past its bound."""
        if not chunks:
            return
        held: Holdings = st.slot
        lo, hi = (0, len(path)) if held_to < 0 else (held_to, held_to)
        while lo < hi:  # how deep st already holds: a prefix of path (prefix-closed)
            mid = (lo + hi) // 2
            if st in path[mid].holders:
                lo = mid + 1
            else:
                hi = mid
        self.blocks += len(chunks) - len(path)
        node = path[-1] if path else self.root
        for chunk in chunks[len(path) :]:  # extends the caller's list: it was walked for this insert
            nxt = Block(chunk, node)
            node.children[chunk] = nxt
            path.append(nxt)
            node = nxt
        stamp = next_ticket()
        for block in path:
            block.holders[st] = stamp
        held.count += len(path) - lo
        held.queue.append((stamp, path[-1]))
        self._evict(st, held)

    def _evict(self, st: WorkerState[W], held: Holdings) -> None:
        queue = held.queue
        while held.count > self.max_blocks and queue:
            stamp, block = queue.popleft()
            node: Block | None = block
            while node is not None and node.holders.get(st) == stamp:  # the root holds nobody
                self._forget(st, node)
                held.count -= 1
                node = node.parent
        if len(queue) > 2 * held.count + _QUEUE_SLACK:  # drop entries whose block was used later
            held.queue = deque(e for e in queue if e[1].holders.get(st) == e[0])

    def _forget(self, st: WorkerState[W], block: Block) -> None:
        del block.holders[st]
        if not block.holders and block.parent is not None:
            del block.parent.children[block.chunk]
            self.blocks -= 1

    def drop(self, st: WorkerState[W]) -> None:
        """Forget everything `st` holds (its cache is gone: new weights, or it left)."""
        held: Holdings = st.slot
        for _, block in held.queue:
            node: Block | None = block
            while node is not None and st in node.holders:
                self._forget(st, node)
                node = node.parent
        held.count = 0
        held.queue.clear()
