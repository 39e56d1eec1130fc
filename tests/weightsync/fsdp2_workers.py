"""An FSDP2 trainer (torch ``fully_shard``, 2 gloo ranks) streaming to receivers in other processes.

Process bodies for `test_fsdp2.py`, run under `weightsync_dist_workers.run_ranks`. Processes 0
and 1 are the trainer's two ranks (their own default gloo group, through a prefix of the
harness's store). Every rank gathers one parameter at a time (`full_tensors`); rank 0 feeds the
gathered stream, bucket by bucket, into the node's `SharedBuffer` (`feed`). From there a
receiver on the same node (process 2) copies each version into an engine through
`LoadWeightsConsumer` (staged), and rank 0 broadcasts the committed slot, zero-copy, over a
`MemberGroup` to a receiver standing for another node (process 3, a streaming
`LoadWeightsConsumer`). Receivers compare with the unsharded model, built and trained on their
own, bit for bit.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import member_workers as m
import torch
import torch.distributed as dist
from torch import nn

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    Cast,
    Fuse,
    Layout,
    LoadWeightsConsumer,
    MemberGroup,
    SharedBuffer,
    SharedBufferReader,
    apply_transforms,
    checksum,
    feed,
    full_tensors,
    layout_entries,
)

DEADLINE = 60.0


class Block(nn.Module):
    """A Llama-named decoder block: attention projections and a gated MLP (no attention math:
    the sync only cares about names, shapes and values)."""

    def __init__(self, hidden: int, kv: int, inter: int) -> None:
        super().__init__()
        self.self_attn = nn.ModuleDict(
            {
                "q_proj": nn.Linear(hidden, hidden, bias=False),
                "k_proj": nn.Linear(hidden, kv, bias=False),
                "v_proj": nn.Linear(hidden, kv, bias=False),
                "o_proj": nn.Linear(hidden, hidden, bias=False),
            }
        )
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(hidden, inter, bias=False),
                "up_proj": nn.Linear(hidden, inter, bias=False),
                "down_proj": nn.Linear(inter, hidden, bias=False),
            }
        )
        self.input_layernorm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = self.input_layernorm(x)
        gate = torch.sigmoid((a["k_proj"](h) * a["v_proj"](h)).mean(-1, keepdim=True))
        x = x + a["o_proj"](a["q_proj"](h) * gate)
        g = self.mlp
        return x + g["down_proj"](nn.functional.silu(g["gate_proj"](h)) * g["up_proj"](h))


class Model(nn.Module):
    def __init__(self, layers: int = 2, hidden: int = 32, kv: int = 8, inter: int = 48) -> None:
        super().__init__()
        self.model = nn.ModuleDict(
            {
                "embed_tokens": nn.Embedding(40, hidden),
                "layers": nn.ModuleList(Block(hidden, kv, inter) for _ in range(layers)),
                "norm": nn.LayerNorm(hidden),
            }
        )
        self.lm_head = nn.Linear(hidden, 40, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model["embed_tokens"](tokens)
        for layer in self.model["layers"]:
            x = layer(x)
        out: torch.Tensor = self.lm_head(self.model["norm"](x))
        return out


def build(seed: int = 0, **sizes: int) -> Model:
    torch.manual_seed(seed)
    return Model(**sizes)


def train_step(model: nn.Module, version: int) -> None:
    """One SGD step on a batch every rank shares (so the sharded step equals the unsharded one)."""
    g = torch.Generator().manual_seed(100 + version)
    tokens = torch.randint(0, 40, (4, 6), generator=g)
    loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.roll(1, 1).flatten())
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            p.add_(p.grad, alpha=-0.5)
            p.grad = None


def reference(version: int, **sizes: int) -> dict[str, torch.Tensor]:
    """The unsharded model at `version`: version 1 is the initial weights, each later one a step."""
    model = build(**sizes)
    for v in range(2, version + 1):
        train_step(model, v)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard(model: nn.Module) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model["layers"]:  # type: ignore[index, union-attr]
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def trainer_group(store: Any, rank: int) -> None:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("fsdp/", store),
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=DEADLINE),
    )


def engine_transforms() -> list[Any]:
    return [Fuse(), Cast(torch.bfloat16)]


class Engine:
    """Stacked bfloat16 parameters loaded through ``load_weights`` (an inference engine's side)."""

    def __init__(self, layout: Layout) -> None:
        entries = [(s.name, torch.empty(s.shape, dtype=s.torch_dtype)) for s in layout.tensors]
        self.params = {n: torch.zeros_like(t) for n, t in apply_transforms(engine_transforms(), entries)}
        self.finalized = 0

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.params[name].copy_(tensor)

    def process_weights_after_loading(self) -> None:
        self.finalized += 1

    def consumer(self, layout: Layout, mode: str) -> LoadWeightsConsumer:
        return LoadWeightsConsumer(
            layout,
            self.load_weights,
            finalize=self.process_weights_after_loading,
            transforms=engine_transforms(),
            mode=mode,  # type: ignore[arg-type]
            expected=self.params,
        )


def _expected_engine(version: int) -> dict[str, torch.Tensor]:
    return dict(apply_transforms(engine_transforms(), reference(version).items()))


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(
        torch.equal(got[n].reshape(-1).view(torch.uint8), want[n].reshape(-1).view(torch.uint8)) for n in want
    )


def scenario_fsdp2_pipeline(rank: int, world: int, port: int, versions: int, bucket: int) -> dict[str, Any]:
    store = m.member_store(rank)
    layout = Layout(layout_entries(build()), bucket)  # every process: same entries, no gather
    out: dict[str, Any] = {"buckets": len(layout.buckets)}
    if rank in (0, 1):
        trainer_group(store, rank)
        model = build()
        shard(model)
        out["sharded"] = all(type(p).__name__ == "DTensor" for p in model.parameters())
        node = SharedBuffer(layout, 2) if rank == 0 else None
        xnode = MemberGroup.create(store, "xnode", 0, 2, DEADLINE) if rank == 0 else None
        if node is not None:
            store.set("node_buffer", node.name)
        own: SharedBufferReader | None = None
        sender = BroadcastSender(layout, xnode, 0) if xnode is not None else None
        for version in range(1, versions + 1):
            if version > 1:
                train_step(model, version)
            if node is not None:
                feed(node, full_tensors(model), version, DEADLINE)
                if own is None:
                    own = SharedBufferReader.attach(node.name)
                own.wait_for_version(version, DEADLINE)  # zero-copy views of the committed slot
                assert sender is not None
                sender.send(own.tensors(), version, DEADLINE)
                # the sync of `version` ends when the node's receiver holds it too (the buffer
                # keeps two versions: the next one may overwrite an unread one)
                store.wait([f"copied/{version}"], timedelta(seconds=DEADLINE))
            else:
                for _ in full_tensors(model):  # rank 1 takes part in every gather
                    pass
            dist.barrier()
        m.finish(store, rank, range(world))
        if own is not None:
            own.close()
        if node is not None:
            node.close()
        dist.destroy_process_group()
        return out
    engine = Engine(layout)
    if rank == 2:  # same node: copies each version out of the node buffer
        reader = SharedBufferReader.attach(store.get("node_buffer").decode())
        consumer = engine.consumer(layout, "staged")
        for version in range(1, versions + 1):
            reader.wait_for_version(version, DEADLINE)
            reader.copy_version(version, consumer, DEADLINE)
            reader.refresh(DEADLINE)
            out[f"v{version}"] = _report(engine, consumer, version)
            store.set(f"copied/{version}", "1")
        reader.close()
    else:  # another node: broadcast from the trainer's rank 0
        xnode = MemberGroup.create(store, "xnode", 1, 2, DEADLINE)
        receiver = BroadcastReceiver(layout, xnode, 0)
        consumer = engine.consumer(layout, "stream")
        for version in range(1, versions + 1):
            receiver.receive(consumer, DEADLINE)
            out[f"v{version}"] = _report(engine, consumer, version)
    m.finish(store, rank, range(world))
    return out


def _report(engine: Engine, consumer: LoadWeightsConsumer, version: int) -> dict[str, Any]:
    return {
        "version": consumer.version,
        "bit_exact": _same(engine.params, _expected_engine(version)),
        "checksum": checksum(engine.params),
        "finalized": engine.finalized,
    }


# -- memory ----------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakRss:
    """Peak resident memory of this process above a baseline, on CPU, where torch keeps no
    allocator statistics: the kernel's high-water mark (VmHWM), reset through
    /proc/self/clear_refs, minus the resident set at the start, minus the shared-memory pages
    the process touched meanwhile (the node buffer's slots, counted apart). Large allocations
    must be returned to the kernel when freed (run with a fixed MALLOC_MMAP_THRESHOLD_), or
    reused heap memory would hide them."""

    def __enter__(self) -> PeakRss:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.rss = _status_kib("VmRSS")
        self.shmem = _status_kib("RssShmem")
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak_extra = 1024 * (_status_kib("VmHWM") - self.rss - (_status_kib("RssShmem") - self.shmem))


def scenario_fsdp2_memory(
    rank: int, world: int, port: int, bucket: int, sizes: dict[str, int]
) -> dict[str, Any]:
    """Rank 0's peak extra memory: streaming into the node buffer vs gathering a full state dict."""
    store = m.member_store(rank)
    trainer_group(store, rank)
    model = build(**sizes)
    layout = Layout(layout_entries(model), bucket)
    shard(model)
    node = SharedBuffer(layout, 1) if rank == 0 else None
    out: dict[str, Any] = {
        "model_bytes": layout.total_bytes,
        "bucket_bytes": layout.max_bucket_nbytes,
        "largest": max(s.nbytes for s in layout.tensors),
        "mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }
    for version, how in ((1, "warmup"), (2, "streamed"), (3, "materialized"), (4, "streamed_again")):
        dist.barrier()
        with PeakRss() as peak:
            if how == "materialized":  # the baseline: the whole state dict gathered, then published
                full = dict(full_tensors(model))
                if node is not None:
                    node.publish(full, version, DEADLINE)
                del full
            elif node is not None:
                feed(node, full_tensors(model), version, DEADLINE)
            else:
                for _ in full_tensors(model):
                    pass
        out[how] = peak.peak_extra
    if node is not None:
        reader = SharedBufferReader.attach(node.name)
        reader.wait_for_version(4, DEADLINE)
        out["bit_exact"] = checksum(reader.tensors()) == checksum(reference(1, **sizes))
        reader.close()
        node.close()
    dist.barrier()
    m.finish(store, rank, range(world))
    dist.destroy_process_group()
    return out
