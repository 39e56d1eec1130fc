"""Streaming senders: an FSDP2 trainer sends its weights one gathered parameter at a time.

Run: hatch run python benchmarks/streaming.py [--quick] [--json PATH] [--rounds N]

Three spawned processes, gloo on loopback. Ranks 0 and 1 are an FSDP2 trainer (torch
``fully_shard`` per decoder block and at the root, its own 2-rank gloo group); rank 2 is a
rollout worker standing for another node, reached by a `BroadcastSender` over a `MemberGroup`
with rank 0. The model is Llama-shaped, fp32: 5 blocks of hidden 1024 / MLP 2816, an 8192-token
embedding and head (317 MiB; ``--quick``: 2 blocks of 512 / 1408, 4096 tokens, 41 MiB), in
buckets of 64 MiB (quick: 16 MiB). Every version changes every weight (``add_(0.5)`` on the
trainer's shards and on the receiver's unsharded reference alike).

Each version is one of four rounds, interleaved, best of ``--rounds`` (default 3; quick 2):

  streamed       both trainer ranks iterate `full_tensors(model)` (each DTensor gathered when
                 reached: the gathers are collectives); rank 0 hands the iterator to
                 ``BroadcastSender.send``, which sends each bucket as it fills; the receiver
                 applies into a ``DoubleBuffer(mode="swap")``.
  materialized   rank 0 gathers the whole state dict first (``dict(full_tensors(model))``),
                 then sends it (the state-dict path: large tensors from their own storage).
  direct         streamed, the receiver landing in place in a ``DirectBuffer`` (large tensors
                 straight into its live tensors, ``max_staging_bytes=0``).
  load_weights   streamed, the receiver a `LoadWeightsConsumer` (staged: the engine's
                 ``load_weights`` copies each weight into its parameter at commit).

The clock runs on rank 0 from the trainer's common start (a barrier, after the receiver said it
is ready) until ``send`` returns: every receiver voted to commit the version. The receiver's
bit-for-bit check against its reference runs outside the clock.

Claims:
  sender_peak_extra_over_two_buckets_plus_largest  rank 0's peak extra resident memory during a
        streamed send (worst round), over twice the largest bucket plus the largest parameter
        (target <= 1.0). Measured as tests/weightsync/test_fsdp2.py does: the kernel's RSS
        high-water mark (VmHWM), reset through /proc/self/clear_refs before the round, minus the
        RSS then; every process runs with MALLOC_MMAP_THRESHOLD_=65536 so that freed tensors go
        back to the kernel (reused heap memory would hide them). The sender's bucket buffers are
        released before every measured round, so they count. The materialized peak is beside it.
  streaming_vs_materialized_speedup  best materialized over best streamed (report).
  fsdp2_bit_exact  1 when every version of every round arrived bit for bit (target 1).
  load_weights_overhead_vs_direct  best load_weights over best direct (report).
"""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta
from typing import Any

import torch
from _claims import arguments, claim, report
from _state import MiB
from _weightsync_dist import peak_rss, reset_peak, run_processes
from torch import nn

KINDS = ("streamed", "materialized", "direct", "load_weights")
DEADLINE = 600.0
SIZES = {
    "full": {"layers": 5, "hidden": 1024, "inter": 2816, "vocab": 8192, "bucket": 64 * MiB},
    "quick": {"layers": 2, "hidden": 512, "inter": 1408, "vocab": 4096, "bucket": 16 * MiB},
}


def _linears(shapes: dict[str, tuple[int, int]]) -> nn.ModuleDict:
    return nn.ModuleDict(
        {name: nn.Linear(fan_in, fan_out, bias=False) for name, (fan_in, fan_out) in shapes.items()}
    )


class Block(nn.Module):
    """A decoder block's weights under Llama's names: the sync sees names, shapes and values, so
    no forward pass is ever run (FSDP2 only asks that one exists)."""

    def __init__(self, h: int, i: int) -> None:
        super().__init__()
        self.self_attn = _linears(dict.fromkeys(("q_proj", "k_proj", "v_proj", "o_proj"), (h, h)))
        self.mlp = _linears({"gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)})
        self.input_layernorm = nn.LayerNorm(h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Model(nn.Module):
    """Embedding, decoder blocks, final norm and head, named as Llama's are."""

    def __init__(self, size: dict[str, int]) -> None:
        super().__init__()
        h, vocab = size["hidden"], size["vocab"]
        blocks = nn.ModuleList(Block(h, size["inter"]) for _ in range(size["layers"]))
        self.model = nn.ModuleDict(
            {"embed_tokens": nn.Embedding(vocab, h), "layers": blocks, "norm": nn.LayerNorm(h)}
        )
        self.lm_head = nn.Linear(h, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def build_model(size: dict[str, int]) -> Model:
    """The model of `size`, seeded: every process builds the same weights."""
    torch.manual_seed(0)
    return Model(size)


def bump(tensors: Any) -> None:
    """The next version: every weight plus 0.5 (on shards and on the unsharded reference alike)."""
    with torch.no_grad():
        for t in tensors:
            t.add_(0.5)


def schedule(rounds: int) -> list[str]:
    """The kind of each version: one warm-up of each, then `rounds` interleaved rounds."""
    return list(KINDS) * (rounds + 1)


# -- processes --------------------------------------------------------------------------------------
def _store(rank: int, port: int) -> Any:
    """Rank 0 hosts the run's TCPStore on loopback; the others connect to it."""
    import torch.distributed as dist

    from rlfleet.weightsync import host_store

    if rank == 0:
        return host_store("127.0.0.1", port, timeout_s=DEADLINE)
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=DEADLINE))


def _sharded(rank: int, store: Any, size: dict[str, int]) -> tuple[Model, Any]:
    """The model, sharded with FSDP2 over the trainer's own gloo group; its layout (global shapes)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlfleet.weightsync import Layout, layout_entries

    trainer_store = dist.PrefixStore("fsdp/", store)
    dist.init_process_group(
        "gloo", store=trainer_store, rank=rank, world_size=2, timeout=timedelta(seconds=DEADLINE)
    )
    model = build_model(size)
    layout = Layout(layout_entries(model), size["bucket"])
    mesh = init_device_mesh("cpu", (2,))
    for block in model.model["layers"]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, layout


def _trainer(rank: int, store: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Ranks 0 and 1: FSDP2 on gloo; rank 0 also sends every version and keeps the clock."""
    import torch.distributed as dist

    from rlfleet.weightsync import BroadcastSender, MemberGroup, full_tensors

    model, layout = _sharded(rank, store, cfg["size"])
    sender = None
    if rank == 0:
        sender = BroadcastSender(layout, MemberGroup.create(store, "xnode", 0, 2, DEADLINE), 0)
    out: dict[str, Any] = {k: [] for k in KINDS} | {f"{k}_peak": [] for k in KINDS}
    for version, kind in enumerate(schedule(cfg["rounds"]), start=1):
        if sender is not None:
            store.wait([f"ready/{version}"], timedelta(seconds=DEADLINE))
            sender.release_buffers()
        dist.barrier()
        rss = reset_peak()
        start = time.perf_counter()
        if sender is None:
            for _ in full_tensors(model):  # every rank takes part in every gather
                pass
        elif kind == "materialized":
            full = dict(full_tensors(model))
            sender.send(full, version, DEADLINE)
            del full
        else:
            sender.send(full_tensors(model), version, DEADLINE)
        out[kind].append(time.perf_counter() - start)
        out[f"{kind}_peak"].append(peak_rss() - rss)
        bump(model.parameters())
    out |= {
        "model_bytes": layout.total_bytes,
        "bucket_bytes": layout.max_bucket_nbytes,
        "largest": max(s.nbytes for s in layout.tensors),
        "buckets": len(layout.buckets),
    }
    dist.destroy_process_group()
    return out


def _receiver(store: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Rank 2: one consumer per round kind over the same live tensors; checks every version."""
    from rlfleet.weightsync import (
        BroadcastReceiver,
        DirectBuffer,
        DoubleBuffer,
        Layout,
        LoadWeightsConsumer,
        MemberGroup,
        checksum,
    )

    reference = build_model(cfg["size"]).state_dict()
    layout = Layout.from_state_dict(reference, cfg["size"]["bucket"])  # = layout_entries(model)
    live = {k: v.clone() for k, v in reference.items()}

    def load_weights(weights: Any) -> None:
        for name, tensor in weights:
            live[name].copy_(tensor)

    consumers = {
        "streamed": DoubleBuffer(live, layout, mode="swap"),
        "direct": DirectBuffer(live, layout, max_staging_bytes=0),
        "load_weights": LoadWeightsConsumer(layout, load_weights),
    }
    consumers["materialized"] = consumers["streamed"]
    receiver = BroadcastReceiver(layout, MemberGroup.create(store, "xnode", 1, 2, DEADLINE), 0)
    exact = []
    for version, kind in enumerate(schedule(cfg["rounds"]), start=1):
        gc.collect()
        store.set(f"ready/{version}", "1")
        receiver.receive(consumers[kind], DEADLINE)
        exact.append(checksum(live) == checksum(reference))
        bump(reference.values())
    return {"bit_exact": exact}


def _body(rank: int, world: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    store = _store(rank, port)
    result = _trainer(rank, store, cfg) if rank < 2 else _receiver(store, cfg)
    if rank == 0:  # the store's host leaves last
        store.wait([f"done/{r}" for r in range(1, world)], timedelta(seconds=DEADLINE))
    else:
        store.set(f"done/{rank}", "1")
    return result


def claims_of(results: dict[int, dict[str, Any]], rounds: int) -> dict[str, Any]:
    trainer, receiver = results[0], results[2]
    best = {k: min(trainer[k][1:]) for k in KINDS}  # the first of each kind warms up
    worst_peak = {k: max(trainer[f"{k}_peak"][1:]) for k in KINDS}
    bound = 2 * trainer["bucket_bytes"] + trainer["largest"]
    mib = {k: round(v / MiB, 1) for k, v in worst_peak.items()}
    print(
        f"model {trainer['model_bytes'] / MiB:.0f} MiB in {trainer['buckets']} buckets of at most "
        f"{trainer['bucket_bytes'] / MiB:.0f} MiB, largest parameter {trainer['largest'] / MiB:.1f} MiB; "
        f"{rounds} rounds\nbest seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in best.items())
    )
    gathers_only = max(results[1]["streamed_peak"][1:]) / MiB
    print(f"rank 0 peak extra MiB (worst round): {mib}; rank 1 (gathers only): {gathers_only:.1f}")
    return {
        "sender_peak_extra_over_two_buckets_plus_largest": claim(
            worst_peak["streamed"] / bound, 1.0, "x (2 buckets + largest)", higher_is_better=False
        ),
        "materialized_peak_extra_over_model": claim(
            worst_peak["materialized"] / trainer["model_bytes"], None, "model copies"
        ),
        "streaming_vs_materialized_speedup": claim(best["materialized"] / best["streamed"], None, "x"),
        "fsdp2_bit_exact": claim(int(all(receiver["bit_exact"])), 1, "all versions"),
        "load_weights_overhead_vs_direct": claim(best["load_weights"] / best["direct"], None, "x time"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = arguments(__doc__.splitlines()[0] if __doc__ else "streaming")
    parser.add_argument("--rounds", type=int, default=0, help="measured rounds per kind (default 3; quick 2)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 3)
    cfg = {"size": SIZES["quick" if args.quick else "full"], "rounds": rounds}
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each spawned process at start-up
    results = run_processes(cfg, 3, 600.0 if args.quick else 1800.0, body=_body)
    return report(claims_of(results, rounds), args.json, title="streaming senders (FSDP2 over gloo)")


if __name__ == "__main__":
    raise SystemExit(main())
