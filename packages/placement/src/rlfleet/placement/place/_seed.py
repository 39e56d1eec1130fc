"""The seed's transfer-info planners, output-identical for every input the seed accepts.

``transfer_info`` maps a sender node id to a list of items ``{"sender", "receiver", "intra_node"}``
(disaggregated) or ``{"all": [{"sender", "receiver"}]}`` (colocated). Senders and receivers are the
very objects passed in (actor handles, ids, ...). Kept quirks, on purpose:

* train-only nodes that get no eval node are absent from the result;
* with ``"Shared"``, intra-node items have no receivers (the sender fills the node's shared buffer)
  and a cross-node item names only the first eval policy of the target node;
* an unknown strategy is only reported when some item is built (a cluster with train-only nodes
  and no eval node returns ``{}`` whatever the strategy).

Errors keep the seed's message as their start; the unknown strategy's goes on to list the valid
ones (`SEED_BUFFER_STRATEGIES`).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from rlfleet.placement._errors import ColocatedSizeError, EmptyEvalNodeError, PlacementError
from rlfleet.placement._public import public

__all__ = [
    "SEED_BUFFER_STRATEGIES",
    "build_transfer_info_for_colocated",
    "build_transfer_info_for_disaggregated",
]

SEED_BUFFER_STRATEGIES: tuple[str, ...] = ("None", "Double", "Shared")


def _policies(placement_info: Mapping[Any, Any], node_id: Hashable, key: str) -> Sequence[Any]:
    entry = placement_info[node_id]
    try:
        return entry[key]  # type: ignore[no-any-return]
    except (KeyError, TypeError):
        raise PlacementError(f"placement_info[{node_id!r}] has no {key!r} list") from None


@public
def build_transfer_info_for_disaggregated(
    placement_info: Mapping[Any, Mapping[str, Sequence[Any]]], weight_buffer_strategy: str
) -> dict[Any, list[dict[str, Any]]]:
    """Who sends to whom, per sender node, when train and eval policies live on different devices.

    Nodes with only eval policies are dealt round-robin to train-only nodes (or, failing those, to
    mixed nodes); each item's sender is the node's train policy ``idx % len(train_policies)``.
    Returns ``transfer_info`` (the seed's docstring promises a tuple; the code returns this dict).
    Raises ValueError("No train policy found") or ValueError("Unsupported weight buffer strategy: ...")
    (the seed's messages; the second goes on to list the valid strategies).
    """
    router_map: dict[Any, list[Any]] = {}
    transfer_info: dict[Any, list[dict[str, Any]]] = {}
    train_nodes: list[Any] = []
    eval_nodes: list[Any] = []
    mixed_nodes: list[Any] = []
    for node_id in placement_info:
        if len(_policies(placement_info, node_id, "train_policies")) == 0:
            eval_nodes.append(node_id)
        elif len(_policies(placement_info, node_id, "eval_policies")) == 0:
            train_nodes.append(node_id)
        else:
            mixed_nodes.append(node_id)
            router_map[node_id] = [node_id]
    if train_nodes:
        for idx, eval_node_id in enumerate(eval_nodes):
            router_map.setdefault(train_nodes[idx % len(train_nodes)], []).append(eval_node_id)
    elif mixed_nodes:
        for idx, eval_node_id in enumerate(eval_nodes):
            router_map[mixed_nodes[idx % len(mixed_nodes)]].append(eval_node_id)
    else:
        raise ValueError("No train policy found")
    for node_id, router_list in router_map.items():
        train_policies = _policies(placement_info, node_id, "train_policies")
        transfer_info[node_id] = []
        for idx, router_node_id in enumerate(router_list):
            item: dict[str, Any] = {
                "sender": train_policies[idx % len(train_policies)],
                "receiver": [],
                "intra_node": False,
            }
            if router_node_id == node_id:
                item["intra_node"] = True
            if weight_buffer_strategy in ["None", "Double"]:
                item["receiver"].extend(_policies(placement_info, router_node_id, "eval_policies"))
            elif weight_buffer_strategy == "Shared":
                if router_node_id != node_id:
                    evals = _policies(placement_info, router_node_id, "eval_policies")
                    if len(evals) == 0:
                        raise EmptyEvalNodeError(
                            f"node {router_node_id!r} has neither train nor eval policies; "
                            "the Shared strategy needs an eval policy to receive for it"
                        )
                    item["receiver"].append(evals[0])
            else:
                valid = ", ".join(repr(v) for v in SEED_BUFFER_STRATEGIES)
                seed_text = f"Unsupported weight buffer strategy: {weight_buffer_strategy}"
                raise ValueError(f"{seed_text} (valid: {valid})")
            transfer_info[node_id].append(item)
    return transfer_info


@public
def build_transfer_info_for_colocated(
    train_list: Sequence[Any], eval_list: Sequence[Any]
) -> dict[str, list[dict[str, Any]]]:
    """Pair eval policy ``i`` with train policy ``i`` (same device): ``{"all": [{"sender", "receiver"}]}``.

    Raises ColocatedSizeError (a ValueError and an AssertionError, like the seed's ``assert``) when
    there are more eval than train policies.
    """
    if not len(train_list) >= len(eval_list):
        raise ColocatedSizeError("train_list must have more policies than eval_list for colocated mode")
    return {"all": [{"sender": train_list[idx], "receiver": policy} for idx, policy in enumerate(eval_list)]}
