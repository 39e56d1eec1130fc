"""Ray glue for communication groups: plan from rlfleet.placement, create on the actors, bounded.

`init_world` asks rank 0 to host the rendezvous store, has every actor join the world group
(each names the ranks that did not show up in time), then creates every planned group with one
call per actor (so one actor creates its groups in plan order, never concurrently).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from rlfleet.placement import CommGroupPlan
from rlfleet.policygroup._errors import WorkerDiedError
from rlfleet.weightsync import CommGroupError


def _describe(plan: CommGroupPlan, rank: int, names: Mapping[Any, str]) -> str:
    info = plan.ranks[rank]
    return f"rank {rank} ({names.get(info.actor_id, info.actor_id)}, node {str(info.node_id)[:12]})"


def wait_all(refs: Sequence[Any], owners: Sequence[str], timeout_s: float, what: str) -> list[Any]:
    """Get every ref within `timeout_s`; errors name the owner whose call failed or did not finish."""
    _ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    if pending:
        late = [owners[i] for i, r in enumerate(refs) if r in set(pending)]
        raise CommGroupError(f"{what}: {', '.join(late)} did not finish within {timeout_s:.1f}s")
    out = []
    for ref, owner in zip(refs, owners, strict=True):
        try:
            out.append(ray.get(ref, timeout=1.0))
        except ray.exceptions.RayActorError as exc:
            raise WorkerDiedError(f"{what}: {owner} died: {exc}") from None
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, CommGroupError):
                raise CommGroupError(f"{what}: {owner}: {cause}", cause.missing_ranks) from None
            raise CommGroupError(f"{what}: {owner} failed: {cause}") from None
    return out


def ray_nodes() -> list[dict[str, Any]]:
    """`ray.nodes()`, typed."""
    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes


def local_host() -> str | None:
    """127.0.0.1 when every alive Ray node runs on this one machine (tests, laptops), else None."""
    try:
        addresses = {n.get("NodeManagerAddress") for n in ray_nodes() if n.get("Alive")}
    except Exception:
        return None
    return "127.0.0.1" if len(addresses) <= 1 else None


def init_world(
    plan: CommGroupPlan,
    actors: Mapping[Any, Any],
    names: Mapping[Any, str],
    backend: str,
    timeout_s: float,
    extra_groups: Sequence[Any] = (),
) -> str:
    """Form the world group, every group of `plan` and `extra_groups` on the actors; returns the epoch."""
    if not plan.ranks:
        return ""
    epoch = uuid.uuid4().hex[:12]
    margin = timeout_s + 15.0
    master = actors[plan.ranks[0].actor_id]
    try:
        addr, port = ray.get(master._get_addr_and_port.remote(local_host()), timeout=margin)
    except ray.exceptions.RayActorError as exc:
        raise WorkerDiedError(f"rendezvous host {_describe(plan, 0, names)} died: {exc}") from None
    except ray.exceptions.GetTimeoutError:
        raise CommGroupError(f"rendezvous host {_describe(plan, 0, names)} did not answer", (0,)) from None
    refs, owners = [], []
    for info in plan.ranks:
        actor = actors[info.actor_id]
        refs.append(
            actor.init_distributed_env.remote(
                rank=info.rank,
                world_size=plan.world_size,
                local_rank=info.local_rank,
                local_world_size=info.local_world_size,
                master_addr=addr,
                master_port=port,
                backend=backend,
                timeout_s=timeout_s,
                epoch=epoch,
            )
        )
        owners.append(_describe(plan, info.rank, names))
    wait_all(refs, owners, margin, "init_distributed_env")
    create_groups(plan, [*plan.groups, *extra_groups], actors, names, backend, timeout_s, registered=True)
    return epoch


def create_groups(
    plan: CommGroupPlan,
    groups: Sequence[Any],
    actors: Mapping[Any, Any],
    names: Mapping[Any, str],
    backend: str,
    timeout_s: float,
    registered: bool = False,
) -> None:
    """Create `groups` (CommGroup) in order, one call per actor.

    `registered`: every rank of the world creates every group (torch.distributed groups, as the
    seed); otherwise members only (standalone groups, what works after a rank died).
    """
    per_actor: dict[int, list[dict[str, Any]]] = {}
    for g in groups:
        spec = {"ranks": list(g.ranks), "mode": g.mode, "group_id": g.group_id}
        for r in range(plan.world_size) if registered else g.ranks:
            per_actor.setdefault(r, []).append(spec)
    refs, owners = [], []
    for rank, specs in per_actor.items():
        actor = actors[plan.ranks[rank].actor_id]
        refs.append(actor.init_comm_groups.remote(specs, backend, timeout_s, registered))
        owners.append(_describe(plan, rank, names))
    if refs:
        wait_all(refs, owners, timeout_s + 15.0, "create communication groups")
