"""Recipe: rlfleet-routing alone, inside an existing asyncio server loop.

Requests carry a session id; `ConsistentHashRouter` keeps a session on one worker (KV-cache
reuse) with bounded load. `async with router.request(session)` waits for a free worker without
blocking the loop and releases it however the request ends, a client that disconnects
(a cancelled task) included. Midway the workers are updated one at a time (drain, swap, new
version) while the others keep serving; with the default `prefer_newest_version=True` a session
stays on its worker until that worker's own update, so sessions do not pile onto the first
updated worker. For prompts, `PrefixAwareRouter` routes by cached prefix instead of by session.
Needs only rlfleet-routing (`pip install ./packages/routing`; no torch, no Ray).

    python examples/recipes/routing_async_server.py
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from rlfleet.routing import ConsistentHashRouter

WORKERS = [f"rollout-{i}" for i in range(4)]


async def serve(router: ConsistentHashRouter[str], session: str, served: Counter[str]) -> None:
    async with router.request(session, timeout=5.0) as worker:  # waits if all are busy/draining
        await asyncio.sleep(random.uniform(0.001, 0.005))  # the worker generates a response
        served[worker] += 1


async def rolling_update(router: ConsistentHashRouter[str], worker: str, version: int) -> None:
    router.set_draining(worker, True)  # no new requests; in-flight ones finish
    await router.wait_drained_async(worker, timeout=5.0)
    await asyncio.sleep(0.01)  # swap the weights here
    router.set_version(worker, version)
    router.set_draining(worker, False)


async def main() -> int:
    random.seed(0)
    router: ConsistentHashRouter[str] = ConsistentHashRouter(WORKERS, load_factor=1.25, max_in_flight=8)
    served: Counter[str] = Counter()
    sessions = [f"session-{i}" for i in range(64)]
    requests = [asyncio.create_task(serve(router, random.choice(sessions), served)) for _ in range(2000)]

    async def update_all() -> None:
        for worker in WORKERS:
            await rolling_update(router, worker, version=1)

    async def disconnect_some() -> None:
        await asyncio.sleep(0.005)
        for task in random.sample(requests, 100):
            task.cancel()  # the client went away: its worker is released

    await asyncio.gather(update_all(), disconnect_some())
    results = await asyncio.gather(*requests, return_exceptions=True)
    answered = sum(1 for r in results if r is None)
    cancelled = sum(1 for r in results if isinstance(r, asyncio.CancelledError))
    print("requests per worker:", dict(sorted(served.items())))
    print(f"answered {answered}, cancelled by their client {cancelled}")
    print("in flight at the end:", router.in_flight, "| versions:", {w: router.version(w) for w in WORKERS})
    ok = answered == sum(served.values()) and answered + cancelled == len(requests) and router.in_flight == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
