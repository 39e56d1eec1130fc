"""The GRPO policy: rollout policies sample answers; an FSDP2 trainer learns from them.

A `GRPOPolicy` runs in every Ray actor of the policy group. Rollout policies (the group's eval
policies) sample answers for prompts in `rollout_step`. The two trainers form their own gloo
world (as ``torchrun`` would), shard the model with torch FSDP2 (``fully_shard``) and take
GRPO steps in `train_step`: FSDP2 all-gathers each layer for the forward and reduce-scatters
its gradients, so every rank holds half of every parameter and of the Adam state.

Weights move after every update, through rlfleet, without a full copy on any trainer: each
rank gathers one parameter at a time (``full_tensor()``, a collective), and the rank that
writes the node's shared buffer packs them into it bucket by bucket (`weightsync.feed`). The
policy group then publishes that version to the rollout policies, which read it zero-copy
(strategy "Shared"). `export_weights` is the collective step the driver calls on every trainer
before ``sync_weights``; `publish_shared` only checks that it happened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from rlfleet.policygroup import BasePolicy, TrainConfig
from rlfleet.weightsync import (
    Deadline,
    Layout,
    SharedBuffer,
    checksum,
    connect_store,
    feed,
    full_tensors,
    host_store,
    layout_entries,
)

from .model import LMConfig, TinyLM, answer_logprobs, sample_answers
from .task import DIGITS


class GRPOPolicy(BasePolicy):
    """Rollout (eval) and FSDP2 trainer roles of the GRPO example."""

    def __init__(
        self, *args: Any, length: int = 8, lm: Mapping[str, int] | None = None, **kwargs: Any
    ) -> None:
        self.length = length
        self.lm_config = LMConfig(context=2 * length + 1, **dict(lm or {}))
        self.node_buffer: SharedBuffer | None = None
        self._fsdp_store: Any = None
        super().__init__(*args, **kwargs)

    # ------------------------------------------------------------------ model and optimizer
    def build_model(self) -> nn.Module:
        return TinyLM(self.lm_config)

    def build_optimizer(self, train_config: TrainConfig | None) -> torch.optim.Optimizer:
        lr = train_config.lr if train_config is not None else 3e-3
        return torch.optim.Adam(self.model.parameters(), lr=lr)

    # ------------------------------------------------------------------ rollout
    def rollout_step(self, env_ret: Mapping[str, Any]) -> dict[str, Any]:
        """One request: a few prompts; `group` sampled answers for each (tokens, not text)."""
        prompts = torch.as_tensor(np.asarray(env_ret["prompts"]), dtype=torch.long)
        group = int(env_ret["group"])
        generator = torch.Generator().manual_seed(int(env_ret["seed"]))
        prompts = prompts.repeat_interleave(group, 0)
        answers = sample_answers(self.model, prompts, self.length, DIGITS, generator)
        return {"answers": answers.numpy(), "version": self.get_weight_version()}

    # ------------------------------------------------------------------ the FSDP2 trainer
    def fsdp_host(self) -> int:
        """Trainer rank 0: host the trainer world's rendezvous store on loopback; returns its port."""
        self._fsdp_store = host_store("127.0.0.1", 0, world_size=2)
        return int(self._fsdp_store.port)

    def init_fsdp(self, rank: int, world_size: int, port: int, timeout_s: float = 60.0) -> bool:
        """Join the trainers' own gloo world and shard the model with FSDP2 (``fully_shard``)."""
        from datetime import timedelta

        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        timeout = timedelta(seconds=timeout_s)
        store = self._fsdp_store
        if store is None:
            store = connect_store("127.0.0.1", port, rank, world_size, Deadline(timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        mesh = init_device_mesh("cpu", (world_size,))
        model: Any = self.model
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.optimizer = self.build_optimizer(self.train_config)  # over the sharded parameters
        return all(type(p).__name__ == "DTensor" for p in model.parameters())

    def train_step(self, batch: Mapping[str, Any], *args: Any, **kwargs: Any) -> dict[str, float]:
        """GRPO with the clipped ratio (no KL term): a few steps on this rank's prompt groups."""
        assert self.optimizer is not None
        extra = self.train_config.extra if self.train_config is not None else {}
        epochs, clip = int(extra.get("epochs", 2)), float(extra.get("clip", 0.2))
        sequences = torch.as_tensor(np.asarray(batch["sequences"]), dtype=torch.long)
        advantages = torch.as_tensor(np.asarray(batch["advantages"]), dtype=torch.float32).unsqueeze(1)
        prompt_len = self.length + 1
        with torch.no_grad():  # the rollout policies served exactly these weights
            old = answer_logprobs(self.model, sequences, prompt_len, DIGITS)
        stats = {"loss": 0.0, "clipped": 0.0}
        for _ in range(epochs):
            ratio = (answer_logprobs(self.model, sequences, prompt_len, DIGITS) - old).exp()
            clipped = ratio.clamp(1 - clip, 1 + clip)
            loss = -torch.min(ratio * advantages, clipped * advantages).mean()
            self.optimizer.zero_grad()
            loss.backward()  # FSDP2 reduce-scatters (averages) the gradients over both ranks
            nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            stats["loss"] += float(loss) / epochs
            stats["clipped"] += float((ratio != clipped).float().mean()) / epochs
        return stats

    # ------------------------------------------------------------------ weights out of the trainer
    def get_weight_layout(self, bucket_bytes: int) -> dict[str, Any]:
        """The full (unsharded) layout, from names, global shapes and dtypes: nothing gathered."""
        return Layout(layout_entries(self.model), bucket_bytes).to_dict()

    def create_shared_writer(
        self, layout: Mapping[str, Any], num_readers: int, prefix: str = "rlfleet", checksums: bool = False
    ) -> str:
        """This trainer writes the node's shared buffer (the policy group asks one per node)."""
        if self.node_buffer is not None:
            self.node_buffer.close()
        self.node_buffer = SharedBuffer(
            Layout.from_dict(layout),
            num_readers,
            timeout_s=self.config.sync_timeout_s,
            prefix=prefix,
            checksums=checksums,
        )
        return self.node_buffer.name

    def export_weights(self, version: int, timeout_s: float) -> dict[str, float]:
        """Every trainer rank: gather one parameter at a time; the node buffer's writer packs
        each into its bucket and commits `version` once every bucket is in."""
        import time

        start = time.perf_counter()
        if self.node_buffer is not None:
            feed(self.node_buffer, full_tensors(self.model), version, Deadline(timeout_s))
        else:
            for _ in full_tensors(self.model):  # take part in every gather
                pass
        return {"seconds": time.perf_counter() - start}

    def publish_shared(self, version: int, timeout_s: float) -> int:
        """Called by `sync_weights` on the writer: `export_weights` must have committed it."""
        if self.node_buffer is None:
            raise RuntimeError(f"trainer {self.index} does not write a node buffer")
        if self.node_buffer.version < version:
            raise RuntimeError(
                f"version {version} is not in the node buffer (it holds {self.node_buffer.version}): "
                "call export_weights on every trainer first (FSDP2 gathers are collectives)"
            )
        return version

    def release_weight_buffers(self) -> int:
        buffer, self.node_buffer = self.node_buffer, None
        if buffer is not None:
            buffer.close()
        return super().release_weight_buffers() + (buffer is not None)

    def weights_checksum(self) -> str:
        """Every trainer rank (collective): the checksum of the full weights, for verification."""
        return checksum(dict(full_tensors(self.model)))
