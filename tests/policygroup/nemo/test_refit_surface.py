"""All 23 calls of NeMo RL's policy worker (seed `nemo_rl_base_policy_worker.txt`) on `BasePolicy`.

The seed's signatures are copied here as data (CI has no copy of the seeds): every parameter of
the seed is in ours, in the same place, of the same kind, with the same default; ours may add
only optional parameters after them. The refit calls of issue 16 match the seed exactly,
annotations included.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
from pg_policies import Tiny

from rlfleet.policygroup import BasePolicy, PolicyConfig

#: The seed's attributes and methods, as the seed writes them (types it imports are Any here).
SEED_ATTRIBUTES = ("model_update_group", "pp_comm_group")
SEED_METHODS = (
    "init_collective(ip: str, port: int, world_size: int, *, train_world_size: int, "
    "nccl_peer: str = 'nemo') -> None",
    "init_nccl_reshard_comm_group(pp_ips: list[str], pp_ports: list[int], pp_size: int, "
    "my_pp_stage: int, sub_world_size: int, my_rank_in_group: int) -> None",
    "prepare_nccl_reshard_refit_info(train_parallelism: dict[str, int], gen_parallelism: dict[str, int], "
    "train_world_size: int, gen_world_size: int) -> dict[str, Any]",
    "nccl_reshard_refit(kv_scales: Optional[dict[str, float]] = None, "
    "refit_timeout_s: Optional[float] = None) -> None",
    "_refit_transport_state(key: str) -> dict",
    "connect_sglang_rollout_engines(*, engine_gpu_counts: list[int], "
    "engine_gpu_offsets: Optional[list[int]] = None) -> None",
    "stand_down_refit_watchdog() -> int",
    "is_alive() -> bool",
    "reset_peak_memory_stats() -> None",
    "get_gpu_info() -> dict[str, Any]",
    "report_device_id() -> str",
    "get_zmq_address() -> str",
    "maybe_init_zmq() -> None",
    "get_free_memory_bytes() -> int",
    "shutdown() -> bool",
    "start_gpu_profiling() -> None",
    "stop_gpu_profiling() -> None",
    "report_node_ip_and_gpu_id() -> tuple[str, int]",
    "get_reference_policy_logprobs(*, data: BatchedDataDict[Any], "
    "micro_batch_size: Optional[int] = None) -> BatchedDataDict[ReferenceLogprobOutputSpec]",
    "finalize_async_save() -> None",
    "finish_training(*args: Any, **kwargs: Any) -> None",
)
#: The calls issue 16 added or gave their meaning: exactly the seed's signature.
EXACT = (
    "_refit_transport_state",
    "connect_sglang_rollout_engines",
    "stand_down_refit_watchdog",
    "get_zmq_address",
    "maybe_init_zmq",
)


def seed_signatures() -> dict[str, inspect.Signature]:
    """Each seed line as a stub function's signature (annotations kept as text)."""
    out = {}
    for line in SEED_METHODS:
        name, rest = line.split("(", 1)
        params, returns = rest.rsplit(") -> ", 1)
        namespace: dict[str, Any] = {}
        source = f"from __future__ import annotations\ndef {name}(self, {params}) -> {returns}: ..."
        exec(compile(source.replace("(self, )", "(self)"), "<seed>", "exec"), namespace)
        out[name] = inspect.signature(namespace[name])
    return out


def _plain(annotation: Any) -> str:
    """An annotation as comparable text: ``Optional[X]`` is ``X | None``."""
    text = str(annotation).replace(" ", "")
    match = re.fullmatch(r"Optional\[(.*)\]", text)
    return f"{match.group(1)}|None" if match else text


def ours_signature(name: str) -> inspect.Signature:
    """BasePolicy's signature of `name`, less the ``_ray_trace_ctx`` that Ray's tracing hook adds to
    the methods of a class once it has been made an actor in this process."""
    signature = inspect.signature(getattr(BasePolicy, name))
    params = [p for p in signature.parameters.values() if p.name != "_ray_trace_ctx"]
    return signature.replace(parameters=params)


def test_the_seed_lists_23_calls() -> None:
    assert len(seed_signatures()) + len(SEED_ATTRIBUTES) == 23


def test_every_seed_attribute_is_present() -> None:
    worker = Tiny(PolicyConfig(), role="train", device="cpu")
    for name in SEED_ATTRIBUTES:
        assert hasattr(worker, name)
        assert getattr(worker, name) is None  # None until a group exists, as in the seed


@pytest.mark.parametrize(("name", "seed"), sorted(seed_signatures().items()))
def test_every_seed_method_takes_the_seeds_arguments(name: str, seed: inspect.Signature) -> None:
    ours = ours_signature(name)
    theirs, mine = list(seed.parameters.values()), list(ours.parameters.values())
    assert [p.name for p in mine[: len(theirs)]] == [p.name for p in theirs], ours
    for s, o in zip(theirs, mine, strict=False):
        assert o.kind == s.kind, f"{name}({o.name}): {o.kind} vs the seed's {s.kind}"
        assert o.default == s.default, f"{name}({o.name}): default {o.default!r} vs {s.default!r}"
    for extra in mine[len(theirs) :]:  # anything we add is optional
        optional = extra.default is not inspect.Parameter.empty
        assert optional or extra.kind in (extra.VAR_POSITIONAL, extra.VAR_KEYWORD), f"{name}({extra.name})"


@pytest.mark.parametrize("name", EXACT)
def test_the_refit_calls_match_the_seed_exactly(name: str) -> None:
    seed = seed_signatures()[name]
    ours = ours_signature(name)
    assert list(ours.parameters) == list(seed.parameters)
    for s, o in zip(seed.parameters.values(), ours.parameters.values(), strict=True):
        assert (o.kind, o.default) == (s.kind, s.default)
        if s.name != "self":
            assert _plain(o.annotation) == _plain(s.annotation), name
    assert _plain(ours.return_annotation).startswith(_plain(seed.return_annotation))


def test_refit_transport_state_is_one_mutable_dict_per_key() -> None:
    worker = Tiny(PolicyConfig(), role="train", device="cpu")
    state = worker._refit_transport_state("sglang_ipc")
    assert state == {}
    state["version"] = 3
    assert worker._refit_transport_state("sglang_ipc") is state
    assert worker._refit_transport_state("other") == {}
    with pytest.raises(ValueError, match="non-empty string"):
        worker._refit_transport_state("")


def test_stand_down_with_nothing_in_flight_returns_zero_at_once() -> None:
    assert Tiny(PolicyConfig(), role="eval", device="cpu").stand_down_refit_watchdog() == 0
