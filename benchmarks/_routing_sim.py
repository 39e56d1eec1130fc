"""Simulated serving workloads for benchmarks/routing.py (no timing here: counts only).

Multi-turn sessions: each session has one of a few shared system prompts; turn t's prompt is
the system prompt, every earlier user message and response, and the new user message. Sessions
end after a few turns and new ones start. A window of requests is in flight (FIFO): the oldest
finishes before a new one is routed, and a session waits for its response before its next
turn, so the sequence of prompts does not depend on the routing.

Each worker has a real prefix cache, simulated exactly: pages of `PAGE` characters chained
from the start of the prompt, least recently used evicted first, `cache_pages` at most. A
request's hit is the cached part of its prompt on the worker it was routed to. The oracle
knows every worker's cache: among workers under the same load bound it takes the one caching
the longest prefix (least loaded on ties). Routers only see what they are told.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from rlfleet.routing import ConsistentHashRouter, LeastLoadRouter, PrefixAwareRouter, Router

PAGE = 16  # characters per page of a worker's cache
WORDS = [
    f"{w} "
    for w in [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "on",
        "that",
        "with",
        "as",
        "by",
        "at",
        "from",
        "it",
        "an",
        "be",
        "this",
        "are",
    ]
]


def text(rng: random.Random, chars: int) -> str:
    """Random words, about `chars` characters (distinct per call)."""
    out: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(WORDS) if rng.random() < 0.7 else f"{rng.randrange(10**6)} "
        out.append(word)
        size += len(word)
    return "".join(out)


@dataclass
class Turn:
    session: str
    prompt: str
    response: str


@dataclass
class _Session:
    name: str
    history: str
    turns_left: int
    rng: random.Random = field(repr=False)


def multi_turn(
    seed: int, requests: int, active: int, window: int, system_prompts: int = 4
) -> Iterator[tuple[Turn, Turn | None]]:
    """`(request, finished)` pairs: a new request and the one that finished to make room."""
    rng = random.Random(seed)
    systems = [text(rng, 1024) for _ in range(system_prompts)]
    made = 0

    def new_session() -> _Session:
        nonlocal made
        made += 1
        srng = random.Random(rng.randrange(2**32))
        return _Session(f"session-{made}", srng.choice(systems), srng.randint(3, 10), srng)

    idle = deque(new_session() for _ in range(active))
    flying: deque[tuple[Turn, _Session]] = deque()
    for _ in range(requests):
        done: Turn | None = None
        if len(flying) >= window or not idle:
            turn, sess = flying.popleft()
            done = turn
            sess.history = turn.prompt + turn.response
            sess.turns_left -= 1
            idle.append(sess if sess.turns_left > 0 else new_session())
        idle.rotate(-rng.randrange(len(idle)))  # a random waiting session sends its next turn
        sess = idle.popleft()
        prompt = sess.history + text(sess.rng, sess.rng.randint(100, 400))
        turn = Turn(sess.name, prompt, text(sess.rng, sess.rng.randint(200, 600)))
        flying.append((turn, sess))
        yield turn, done


def pages(s: str) -> list[int]:
    """Chained page keys: equal lists up to the first page where two texts differ."""
    keys: list[int] = []
    h = 0
    for i in range(0, len(s) - PAGE + 1, PAGE):
        h = hash((h, s[i : i + PAGE]))
        keys.append(h)
    return keys


class Cache:
    """One worker's real prefix cache (exact, LRU over pages, prefix-closed)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()

    def match(self, keys: list[int]) -> int:
        lo, hi = 0, len(keys)  # prefix-closed: binary search for the first missing page
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in self.lru:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def insert(self, keys: list[int]) -> None:
        lru = self.lru
        for k in reversed(keys):  # deepest first: ancestors end up more recent
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > self.capacity:
            lru.popitem(last=False)


class Oracle:
    """Knows every cache: the longest cached prefix under the load bound, least loaded on ties."""

    def __init__(self, workers: int, caches: list[Cache], load_factor: float) -> None:
        self.loads = [0] * workers
        self.caches = caches
        self.c = load_factor

    def select(self, keys: list[int]) -> int:
        total = sum(self.loads)
        bound = math.ceil(self.c * (total + 1) / len(self.loads))
        scored = [
            (-c.match(keys), self.loads[w], w) for w, c in enumerate(self.caches) if self.loads[w] < bound
        ]
        w = min(scored)[2]
        self.loads[w] += 1
        return w

    def release(self, w: int) -> None:
        self.loads[w] -= 1


def hit_rate(
    policy: str, *, workers: int, requests: int, active: int, window: int, cache_pages: int, seed: int = 0
) -> float:
    """Cached characters over prompt characters for `policy` routing the multi-turn workload."""
    caches = [Cache(cache_pages) for _ in range(workers)]
    names = list(range(workers))
    select: Callable[[Turn, list[int]], int]
    release: Callable[[int], None]
    if policy == "oracle":
        oracle = Oracle(workers, caches, 1.25)
        select, release = (lambda t, k: oracle.select(k)), oracle.release
    else:
        router: Router[int]
        if policy == "prefix_aware":
            text_block = PrefixAwareRouter().block_size[0]  # the same cache size, in its blocks
            router = PrefixAwareRouter(names, max_blocks=cache_pages * PAGE // text_block)
            select = lambda t, k: router.select(t.prompt)  # noqa: E731
        elif policy == "consistent_hash":
            router = ConsistentHashRouter(names)
            select = lambda t, k: router.select(t.session)  # noqa: E731
        else:
            router = LeastLoadRouter(names)
            select = lambda t, k: router.select()  # noqa: E731
        release = router.release
    where: dict[int, int] = {}
    hit = total = 0
    for turn, done in multi_turn(seed, requests, active, window):
        if done is not None:
            w = where.pop(id(done))
            caches[w].insert(pages(done.prompt + done.response))
            release(w)
        keys = pages(turn.prompt)
        w = select(turn, keys)
        hit += caches[w].match(keys) * PAGE
        total += len(turn.prompt)
        caches[w].insert(keys)
        where[id(turn)] = w
    return hit / total


@dataclass
class Moves:
    """Fractions of sessions served away from their home during a window of requests."""

    unforced: float  # by a worker other than home while home was serving (the policy's choice)
    forced: float  # ... counting the requests made while home was drained for its swap too


def rolling_update_moves(
    make: Callable[[], Router[Any]],
    *,
    sessions: int,
    window: int,
    gap: int,
    update: bool = True,
    seed: int = 0,
) -> Moves:
    """Sessions moved during a rolling update of every worker (or an equally long window without
    one: the baseline of moves the load bound makes anyway). A session's home is the worker
    that served most of its requests before; the update drains, swaps and undrains one worker
    at a time while requests keep coming (a FIFO window of `window` in flight)."""
    router = make()
    rng = random.Random(seed)
    keys = [f"session-{i}" for i in range(sessions)]
    flying: deque[Any] = deque()
    before: dict[str, list[Any]] = {k: [] for k in keys}
    home: dict[str, Any] = {}
    unforced: set[str] = set()
    forced: set[str] = set()

    def step(draining: Any = None) -> None:
        if len(flying) >= window:
            router.release(flying.popleft())
        key = rng.choice(keys)
        worker = router.select(key)
        flying.append(worker)
        if not home:
            before[key].append(worker)
        elif worker != home.get(key, worker):
            (forced if home.get(key) == draining else unforced).add(key)

    for _ in range(sessions * 8):
        step()
    home.update({k: max(set(ws), key=ws.count) for k, ws in before.items() if ws})
    for worker in router.workers:
        if update:
            router.set_draining(worker, True)
        for _ in range(window):  # the drain: in-flight requests finish while new ones arrive
            step(worker if update else None)
            if not router.loads[worker]:
                break
        if update:
            router.set_version(worker, 1)  # the swap
            router.set_draining(worker, False)
        for _ in range(gap):
            step()
    while flying:
        router.release(flying.popleft())
    n = len(home)
    return Moves(unforced=len(unforced) / n, forced=len(unforced | forced) / n)


@dataclass
class Staleness:
    """Requests routed during rolling updates and how many went to a worker over one version behind."""

    requests: int
    over: int  # routed to a worker more than one version behind the latest committed version
    max_behind: int  # the most versions behind any routed request was


def staleness_run(
    max_staleness: int | None,
    prefer: bool | str = True,
    *,
    workers: int,
    versions: int,
    window: int,
    gap: int,
    seed: int = 0,
) -> Staleness:
    """Rolling updates to versions 1..`versions` while requests keep coming (a FIFO window of
    `window` in flight, `gap` requests between two workers' swaps). The trainer announces each
    version (`set_latest_version`) before the first worker swaps; the last worker is slow: it
    swaps only every third version. Counts, not timings."""
    names = list(range(workers))
    router = LeastLoadRouter(names, max_staleness=max_staleness, prefer_newest_version=prefer)  # type: ignore[arg-type]
    rng = random.Random(seed)
    slow = names[-1]
    flying: deque[int] = deque()
    requests = over = max_behind = 0

    def step() -> None:
        nonlocal requests, over, max_behind
        if len(flying) >= window or (flying and rng.random() < 0.5):
            router.release(flying.popleft())
        worker = router.select()
        behind = (router.latest_version or 0) - router.version(worker)
        requests += 1
        over += behind > 1
        max_behind = max(max_behind, behind)
        flying.append(worker)

    for _ in range(window * 4):
        step()
    for version in range(1, versions + 1):
        router.set_latest_version(version)
        for worker in names:
            if worker == slow and version % 3:
                continue
            router.set_draining(worker, True)
            while router.loads[worker]:  # the drain: in-flight requests finish as new ones arrive
                step()
            router.set_version(worker, version)
            router.set_draining(worker, False)
            for _ in range(gap):
                step()
    while flying:
        router.release(flying.popleft())
    return Staleness(requests, over, max_behind)
