"""An engine-shaped model with ``load_weights`` and the process bodies of the load_weights tests.

`ServingModel` stands in for an inference engine's model class: stacked ``qkv_proj`` /
``gate_up_proj`` parameters in bfloat16, a ``load_weights(weights)`` that copies each pair
into the parameter of that name (what vLLM's default weight loader does for a replicated
parameter) and a ``process_weights_after_loading`` that derives state from the loaded weights.
The trainer side is a Llama-named float32 state dict (`trainer_state`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import member_workers as m
import torch
import weightsync_dist_workers as w

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    Cast,
    Fuse,
    Layout,
    LoadWeightsConsumer,
    MemberGroup,
    PartialLoadError,
    WeightSyncError,
    apply_transforms,
    checksum,
)

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 8, 2, 8, 96, 50, 2
BUCKET = 16 * 1024
DEADLINE = 60.0


def trainer_state(version: int) -> dict[str, torch.Tensor]:
    """A Llama-named float32 model (grouped-query attention), different for every version."""
    g = torch.Generator().manual_seed(7000 + version)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {"model.embed_tokens.weight": t(VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[f"{p}self_attn.q_proj.weight"] = t(HEADS * HEAD_DIM, HIDDEN)
        sd[f"{p}self_attn.k_proj.weight"] = t(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[f"{p}self_attn.v_proj.weight"] = t(KV_HEADS * HEAD_DIM, HIDDEN)
        sd[f"{p}self_attn.o_proj.weight"] = t(HIDDEN, HEADS * HEAD_DIM)
        sd[f"{p}mlp.gate_proj.weight"] = t(INTER, HIDDEN)
        sd[f"{p}mlp.up_proj.weight"] = t(INTER, HIDDEN)
        sd[f"{p}mlp.down_proj.weight"] = t(HIDDEN, INTER)
        sd[f"{p}input_layernorm.weight"] = t(HIDDEN)
    sd["model.norm.weight"] = t(HIDDEN)
    sd["lm_head.weight"] = t(VOCAB, HIDDEN)
    return sd


def trainer_layout() -> Layout:
    return Layout.from_state_dict(trainer_state(0), BUCKET)


def engine_transforms() -> list[Any]:
    return [Fuse(), Cast(torch.bfloat16)]


def engine_view(version: int) -> dict[str, torch.Tensor]:
    """What the engine must hold after loading `version` (computed without any transport)."""
    return {n: t.clone() for n, t in apply_transforms(engine_transforms(), trainer_state(version).items())}


class ServingModel(torch.nn.Module):
    """Stacked projections in bfloat16, loaded through ``load_weights`` like an engine's model."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.params = torch.nn.ParameterDict()
        for name, tensor in engine_view(0).items():
            self.params[name.replace(".", "__")] = torch.nn.Parameter(torch.zeros_like(tensor), False)
        self.calls = 0
        self.pairs = 0
        self.finalized = 0
        self.fail_after = fail_after  # raise after this many pairs (an engine that breaks mid-load)
        self.derived: torch.Tensor | None = None

    def named(self) -> dict[str, torch.Tensor]:
        return {key.replace("__", "."): p for key, p in self.params.items()}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        self.calls += 1
        params = self.named()
        loaded = set()
        for name, tensor in weights:
            if self.fail_after is not None and self.pairs >= self.fail_after:
                raise RuntimeError(f"engine out of memory while loading {name}")
            param = params[name]
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: {tuple(tensor.shape)} into {tuple(param.shape)}")
            param.data.copy_(tensor)
            loaded.add(name)
            self.pairs += 1
        return loaded

    def process_weights_after_loading(self) -> None:
        self.finalized += 1
        self.derived = self.named()["model.layers.0.mlp.gate_up_proj.weight"].t().contiguous()


def engine_checksum(model: ServingModel) -> str:
    return checksum(model.named())


# -- process bodies ------------------------------------------------------------------------------
def scenario_load_weights_broadcast(rank: int, world: int, port: int) -> dict[str, Any]:
    """Process 0 broadcasts versions 1, 2 (complete), 3 (its sender fails after two buckets went
    out) and 4 (complete) to a staged receiver (process 1) and a streaming one (process 2)."""
    store = m.member_store(rank)
    group = MemberGroup.create(store, "load_weights", rank, world, timeout_s=60.0)
    layout = trainer_layout()
    out: dict[str, Any] = {}
    if rank == 0:
        sender = BroadcastSender(layout, group, 0, checksums=True)
        for version in (1, 2):
            sender.send(trainer_state(version), version, DEADLINE)
        bucket_two = layout.buckets[2].tensors[0].name  # produced after buckets 0 and 1 went out
        try:
            sender.send(w.FlakyMapping(trainer_state(3), bucket_two, 1, "raise"), 3, DEADLINE)
        except WeightSyncError as exc:
            out["v3"] = f"{type(exc).__name__}: {exc}"
        sender.send(trainer_state(4), 4, DEADLINE)
    else:
        mode = "staged" if rank == 1 else "stream"
        model = ServingModel()
        told: list[str] = []
        consumer = LoadWeightsConsumer(
            layout,
            model.load_weights,
            finalize=model.process_weights_after_loading,
            transforms=engine_transforms(),
            mode=mode,
            expected=model.named(),
            on_partial=lambda e: told.append(f"{e.mode}:{e.version}"),
        )
        receiver = BroadcastReceiver(layout, group, 0)
        for version in (1, 2, 3, 4):
            entry: dict[str, Any] = {}
            try:
                receiver.receive(consumer, DEADLINE)
            except WeightSyncError as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
            last = consumer.last_error
            entry.update(
                version=consumer.version,
                torn=consumer.torn,
                checksum=engine_checksum(model),
                finalized=model.finalized,
                told=list(told),
                partial=(last.mode, last.version, str(last)) if isinstance(last, PartialLoadError) else None,
                derived_ok=model.derived is not None
                and torch.equal(model.derived, model.named()["model.layers.0.mlp.gate_up_proj.weight"].t()),
            )
            out[f"v{version}"] = entry
        out["calls"] = model.calls
    m.finish(store, rank, range(world))
    return out
