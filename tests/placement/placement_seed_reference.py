"""Literal transcription of the seed's planning logic (rlightning PolicyGroup), the oracle for
seed-equivalence tests. Only the logger calls and Ray plumbing are removed; do not "fix" anything here.
"""

from collections import defaultdict
from typing import Any


def build_transfer_info_for_disaggregated(
    placement_info: dict[str, dict[str, list]], weight_buffer_strategy: str
):
    # init transfer info
    router_map = {}
    transfer_info = {}
    node_info = {"train_nodes": [], "eval_nodes": [], "mixed_nodes": []}

    # classify nodes into train/eval/mixed nodes
    for node_id, policies_info in placement_info.items():
        if len(policies_info["train_policies"]) == 0:
            node_info["eval_nodes"].append(node_id)
        elif len(policies_info["eval_policies"]) == 0:
            node_info["train_nodes"].append(node_id)
        else:
            node_info["mixed_nodes"].append(node_id)
            router_map[node_id] = [node_id]

    # process the router of the node which only has eval_policy
    if len(node_info["train_nodes"]) > 0:
        # if exist independent train_node, average assign eval_policy to train_node
        for idx, eval_node_id in enumerate(node_info["eval_nodes"]):
            train_node_id = node_info["train_nodes"][idx % len(node_info["train_nodes"])]
            if train_node_id not in router_map:
                router_map[train_node_id] = []
            router_map[train_node_id].append(eval_node_id)
    elif len(node_info["mixed_nodes"]) > 0:
        # if not exist independent train_node, average assign eval_policy to mixed_node
        for idx, eval_node_id in enumerate(node_info["eval_nodes"]):
            mixed_node_id = node_info["mixed_nodes"][idx % len(node_info["mixed_nodes"])]
            router_map[mixed_node_id].append(eval_node_id)
    else:
        raise ValueError("No train policy found")

    for node_id, router_list in router_map.items():
        train_policies = placement_info[node_id]["train_policies"]
        transfer_info[node_id] = []
        for idx, router_node_id in enumerate(router_list):
            # average assign receiver_node to the train_policy of sender_node
            transfer_info_item = {
                "sender": train_policies[idx % len(train_policies)],
                "receiver": [],
                "intra_node": False,
            }
            if router_node_id == node_id:
                transfer_info_item["intra_node"] = True
            if weight_buffer_strategy in ["None", "Double"]:
                transfer_info_item["receiver"].extend(placement_info[router_node_id]["eval_policies"])
            elif weight_buffer_strategy == "Shared":
                if router_node_id != node_id:
                    transfer_info_item["receiver"].append(placement_info[router_node_id]["eval_policies"][0])
            else:
                raise ValueError(f"Unsupported weight buffer strategy: {weight_buffer_strategy}")
            transfer_info[node_id].append(transfer_info_item)

    return transfer_info


def build_transfer_info_for_colocated(train_list: list[Any], eval_list: list[Any]):
    transfer_info_list = []
    assert len(train_list) >= len(eval_list), (
        "train_list must have more policies than eval_list for colocated mode"
    )
    # here we assume the train_list and eval_list are in the same order
    for idx, policy in enumerate(eval_list):
        transfer_info_item = {
            "sender": train_list[idx],
            "receiver": policy,
        }
        transfer_info_list.append(transfer_info_item)
    return {"all": transfer_info_list}


def init_placement_info(train_list: list[Any], eval_list: list[Any], node_of: dict[Any, Any]) -> dict:
    """The seed's init_placement_info loop, ``ray.get(policy._get_node_id.remote())`` replaced by a lookup."""
    placement_info: dict = {}
    for policy in train_list:
        node_id = node_of[policy]
        if node_id not in placement_info:
            placement_info[node_id] = {
                "train_policies": [],
                "eval_policies": [],
            }
        placement_info[node_id]["train_policies"].append(policy)
    for policy in eval_list:
        node_id = node_of[policy]
        if node_id not in placement_info:
            placement_info[node_id] = {
                "train_policies": [],
                "eval_policies": [],
            }
        placement_info[node_id]["eval_policies"].append(policy)
    return placement_info


def init_comm_group(
    all_policies: list[Any],
    train_list: list[Any],
    node_of: dict[Any, Any],
    gpu_of: dict[Any, Any],
    transfer_info: dict,
    weight_buffer_strategy: str,
) -> dict[str, Any]:
    """The seed's init_comm_group with each remote call replaced by a lookup; returns what it would
    create: ranks, local ranks, every group creation call in order, and the rendezvous actor."""
    calls: list[Any] = []
    actors_by_node = defaultdict(list)
    for policy in all_policies:
        node_id = node_of[policy]
        actors_by_node[node_id].append(policy)

    sorted_actors = []
    local_rank_list = []
    local_world_size_list = []
    for node_id in actors_by_node:
        actors_by_node[node_id] = sorted(actors_by_node[node_id], key=lambda x: gpu_of[x])
        sorted_actors.extend(actors_by_node[node_id])
        local_world_size = len(actors_by_node[node_id])
        local_rank_list.extend(range(local_world_size))
        local_world_size_list.extend([local_world_size] * local_world_size)

    master = sorted_actors[0]
    rank_of = {policy: rank for rank, policy in enumerate(sorted_actors)}

    for node_actors in actors_by_node.values():
        intra_node_ranks = [rank_of[policy] for policy in node_actors]
        calls.append(("INTRA_NODE", intra_node_ranks))

    if weight_buffer_strategy != "None" and transfer_info:
        for node_id, info in transfer_info.items():  # noqa: B007 (kept as in the seed)
            for transfer_info_item in info:
                if len(transfer_info_item["receiver"]) == 0:
                    continue
                weight_transfer_ranks = [
                    rank_of[policy]
                    for policy in [transfer_info_item["sender"]] + transfer_info_item["receiver"]
                ]
                calls.append(("WEIGHT_TRANSFER", weight_transfer_ranks))

    if train_list:
        ddp_train_ranks = [rank_of[policy] for policy in train_list]
        calls.append(("TRAIN_DATA_PARALLEL", ddp_train_ranks))

    return {
        "sorted_actors": sorted_actors,
        "local_rank_list": local_rank_list,
        "local_world_size_list": local_world_size_list,
        "master": master,
        "calls": calls,
    }
