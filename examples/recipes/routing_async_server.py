"""Recipe: rlfleet-routing alone, inside an existing asyncio server loop.

Requests carry a session id; `ConsistentHashRouter` keeps a session on one worker (KV-cache
reuse) with bounded load, and `release` runs when the response is done. Midway the workers are
updated one at a time (drain, swap, new version): the others keep serving, and requests prefer
workers already on the newest version.
Needs only `pip install rlfleet-routing` (no torch, no Ray).

    python examples/recipes/routing_async_server.py
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from rlfleet.routing import ConsistentHashRouter

WORKERS = [f"rollout-{i}" for i in range(4)]


async def serve(router: ConsistentHashRouter[str], session: str, served: Counter[str]) -> None:
    worker = await asyncio.to_thread(router.select, session, timeout=5.0)  # waits if all are busy/draining
    try:
        await asyncio.sleep(random.uniform(0.001, 0.005))  # the worker generates a response
        served[worker] += 1
    finally:
        router.release(worker)


async def rolling_update(router: ConsistentHashRouter[str], worker: str, version: int) -> None:
    router.set_draining(worker, True)  # no new requests; in-flight ones finish
    await asyncio.to_thread(router.wait_drained, worker, 5.0)
    await asyncio.sleep(0.01)  # swap the weights here
    router.set_version(worker, version)
    router.set_draining(worker, False)


async def main() -> int:
    random.seed(0)
    router: ConsistentHashRouter[str] = ConsistentHashRouter(WORKERS, load_factor=1.25)
    served: Counter[str] = Counter()
    sessions = [f"session-{i}" for i in range(64)]
    requests = [serve(router, random.choice(sessions), served) for _ in range(2000)]

    async def update_all() -> None:
        for worker in WORKERS:
            await rolling_update(router, worker, version=1)

    await asyncio.gather(*requests[:1000], update_all())
    await asyncio.gather(*requests[1000:])
    print("requests per worker:", dict(sorted(served.items())))
    print("in flight at the end:", router.in_flight, "| versions:", {w: router.version(w) for w in WORKERS})
    return 0 if sum(served.values()) == 2000 and router.in_flight == 0 else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
