"""Process bodies for the nccl_reshard worker-call tests (plain spawned processes, no Ray)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.multiprocessing as mp
from refit_procs import collect, report
from testkit import free_port, outcome

from rlfleet.placement import Parallelism, ParamSpec, plan_reshard
from rlfleet.policygroup import BasePolicy, PolicyConfig

H, V = 16, 32
TRAIN = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}
GEN = {"tp": 2}


def specs(h: int = H, v: int = V) -> list[ParamSpec]:
    """Two layers of a small decoder (hidden `h`, vocabulary `v`), stages first and last."""
    out = [ParamSpec("embed", (v, h), "bfloat16", tp_dim=0, stage="first")]
    for i in range(2):
        out += [
            ParamSpec(
                f"l{i}_qkv",
                (4 * h, h),
                "bfloat16",
                tp_dim=0,
                layer=i,
                parts=((f"l{i}_q", 2 * h), (f"l{i}_k", h), (f"l{i}_v", h)),
            ),
            ParamSpec(f"l{i}_o", (h, 2 * h), "bfloat16", tp_dim=1, layer=i),
            ParamSpec(f"l{i}_norm", (h,), "float32", layer=i),
        ]
    out += [ParamSpec("head", (v, h), "bfloat16", tp_dim=0, stage="last")]
    return out


def pieces(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + version)
    out = {}
    for s in specs():
        for piece, size in s.pieces:
            shape = list(s.shape)
            shape[s.concat_dim] = size
            out[piece] = torch.randn(shape, generator=g).to(getattr(torch, s.dtype))
    return out


def shard(spec: ParamSpec, full: Mapping[str, torch.Tensor], tp: int, tp_rank: int) -> torch.Tensor:
    dim = spec.concat_dim
    split = spec.tp_dim is not None and tp > 1
    return torch.cat([full[p].chunk(tp, dim)[tp_rank] if split else full[p] for p, _ in spec.pieces], dim)


class Policy(BasePolicy):
    """A worker whose model holds exactly its shard of `specs()` (plus a kv-cache scale buffer)."""

    def __init__(self, role: str, index: int, config: PolicyConfig | None = None) -> None:
        self.plan = plan_reshard(self.specs(), Parallelism.coerce(TRAIN, 2), Parallelism.coerce(GEN, 2))
        self.side = "train" if role == "train" else "gen"
        self.par = self.plan.train if self.side == "train" else self.plan.gen
        config = PolicyConfig(group_timeout_s=30.0) if config is None else config
        super().__init__(config, role=role, index=index, device="cpu")

    def specs(self) -> list[ParamSpec]:
        """The model's parameters, whole (a subclass sizes its own)."""
        return specs()

    def pieces(self, version: int) -> dict[str, torch.Tensor]:
        """Every piece's value at `version`."""
        return pieces(version)

    def build_model(self) -> torch.nn.Module:
        module = torch.nn.Module()
        for name, shape, dtype in self.plan.local_params(self.side, self.index):
            module.register_parameter(
                name, torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, dtype)))
            )
        module.register_buffer("k_scale", torch.ones(()))
        return module

    def reshard_param_specs(self) -> Sequence[ParamSpec]:
        return self.specs()

    def reshard_state_dict(self) -> Mapping[str, torch.Tensor]:
        state = super().reshard_state_dict()
        return {k: v for k, v in state.items() if k != "k_scale"}

    def expected(self, version: int) -> dict[str, torch.Tensor]:
        full = self.pieces(version)
        by_name = {s.name: s for s in self.specs()}
        tp_rank = self.par.coords(self.index)[0]
        return {
            name: shard(by_name[name], full, self.par.tp, tp_rank)
            for name, _, _ in self.plan.local_params(self.side, self.index)
        }

    def load(self, version: int) -> None:
        with torch.no_grad():
            for name, tensor in self.expected(version).items():
                getattr(self.model, name).copy_(tensor)

    def matches(self, version: int) -> bool:
        """Every local tensor equals `version`'s bit for bit."""
        return all(
            torch.equal(getattr(self.model, n).detach().view(torch.uint8), t.view(torch.uint8))
            for n, t in self.expected(version).items()
        )


def worker(rank: int, ports: Sequence[int], queue: Any) -> None:
    """World ranks 0, 1: training stages 0 and 1; 2, 3: generation tp ranks 0 and 1."""
    report(queue, rank, lambda: _body(rank, ports))


def _body(rank: int, ports: Sequence[int]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    train = rank < 2
    policy = Policy("train" if train else "eval", rank if train else rank - 2)
    ips = ["127.0.0.1", "127.0.0.1"]
    if train:
        policy.init_nccl_reshard_comm_group(ips, list(ports), 2, rank, 3, 0)
    else:
        policy.init_nccl_reshard_comm_group(ips, list(ports), 2, -1, 3, 1 + policy.index)
    out["info"] = policy.prepare_nccl_reshard_refit_info(TRAIN, GEN, 2, 2)
    if train:
        policy.load(1)
        out["v1"] = outcome(lambda: policy.nccl_reshard_refit(kv_scales={"k_scale": 0.25}))
        policy.load(2)
        if rank == 1:
            time.sleep(4.0)  # stalls past the generation workers' deadline
        out["stall"] = outcome(lambda: policy.nccl_reshard_refit(refit_timeout_s=6.0))
    else:
        out["v1"] = outcome(lambda: policy.nccl_reshard_refit())
        out["v1_exact"] = policy.matches(1)
        out["k_scale"] = float(policy.model.k_scale)
        out["kv_scales"] = policy.reshard_kv_scales
        out["version"] = policy.get_weight_version()
        before = policy.get_weight_checksum()
        out["stall"] = outcome(lambda: policy.nccl_reshard_refit(refit_timeout_s=2.0))
        out["intact"] = policy.get_weight_checksum() == before and policy.matches(1)
        out["version_after"] = policy.get_weight_version()
    out["stats"] = policy.get_reshard_stats()
    return out


def run(
    timeout: float = 240.0, body: Callable[[int, Sequence[int], Any], None] | None = None
) -> dict[int, Any]:
    """Four spawned ranks running `body` (default `worker`) with two stages' ports; their results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    ports = [free_port(), free_port()]
    target = worker if body is None else body
    procs = [ctx.Process(target=target, args=(r, ports, queue), daemon=True) for r in range(4)]
    return collect(procs, queue, len(procs), timeout)
