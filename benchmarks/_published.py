"""Published weight-sync setups, each system's own plan priced with a hardware profile.

Every row prices the plan the system itself runs (read from its code and documentation) with
``rlfleet.placement.HARDWARE_PROFILES`` and the documented cost terms below, beside the time the
system published. Nothing is tuned per row: the only per-row inputs are the published setup
(model bytes and tensor counts from the model's config, cluster shape, bucket size, who sends
what to whom) and, where a setup is not fully published, an assumption stated in the row.

Cost terms used for every system (sources in ``rlfleet/placement/_profiles.py``):

* wire: a single-root NCCL broadcast across nodes runs several channels over the node's NICs, so
  it moves ``min(8 NICs x 50 GB/s, NVLink 450 GB/s) x 0.94`` (not a chain over one NIC per hop);
  a point-to-point or RDMA transfer moves ``50 GB/s x 0.94`` per GPU NIC;
* per tensor: 0.18 ms each time a process handles one tensor (an engine's ``load_weights`` call,
  a pack or unpack loop in Python), NeMo RL's measured per-handle cost of its vLLM refit;
* per bucket: a stream synchronisation (0.05 ms) and, where the system does one per bucket, a
  control round trip (1 ms: a barrier or ZeroMQ message);
* copies: PCIe Gen5 52 GB/s host to device, half the HBM bandwidth for a device copy;
* stages of a double-buffered system overlap bucket by bucket (``pipeline_seconds``).

Fully published rows (their setup and plan are public, so the prediction can be checked):
checkpoint-engine Kimi-K2 and DeepSeek-V3.1 on 256 H20, verl Qwen3-30B-A3B on 4x8 H100, NeMo RL
DeepSeek-V3 broadcast and nccl_reshard on 64x8 H100; from the state-of-the-art notes (section 3,
issue 27): verl ``delta_sharded`` Qwen3-235B-A22B priced with its published delta size, vLLM's
sharded RDT transfer of Kimi-K2 and Qwen3-235B-A22B, SGLang's RDMA P2P update of Kimi-K2 and
Qwen3-235B-A22B, and prime-rl's NIXL pull of GLM-5.2 (each row states what it assumes where the
setup leaves a term open). Not fully published: Awex (cluster shape,
parallelism and tensor counts unstated) and Perplexity (the inference parallelism is unstated);
they are shown with their assumptions and left out of ``worst_published_over_predicted``.

"Ours" is rlfleet's plan for the same cluster and receivers (``plan_transfer`` when every receiver
needs the whole model, ``plan_reshard`` + ``price_reshard`` when receivers are tensor-parallel),
transfer only; the bound is physical (bytes each receiver needs over line rate, nothing else).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlfleet.placement import (
    HARDWARE_PROFILES,
    CostModel,
    ParamSpec,
    Placement,
    Topology,
    WorkerPlacement,
    pipeline_seconds,
    plan_reshard,
    plan_transfer,
    price_reshard,
)

GPUS = 8


@dataclass
class Row:
    system: str
    setup: str
    published: tuple[float, float]  # (low, high) seconds; equal when one figure is published
    source: str
    predicted: float
    ours: float
    bound: float
    fully_published: bool
    assumptions: str = ""
    terms: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """max(p/q, q/p) against the worse end of the published range."""
        return max(max(p / self.predicted, self.predicted / p) for p in self.published)

    @property
    def ours_over_bound(self) -> float:
        return self.ours / self.bound if self.bound > 0 else math.inf


def deepseek_style_tensors(
    layers: int, dense: int, experts: int, *, fp8: bool, shared: int = 1, mtp: int = 0
) -> int:
    """Tensors in a DeepSeek-V3-style checkpoint (MLA attention, MoE), from its config.json.

    FP8 block quantisation stores a ``weight_scale_inv`` beside every linear weight.
    """
    s = 2 if fp8 else 1
    attn = 5 * s + 2  # q_a, q_b, kv_a, kv_b, o (+ scales), q_a_layernorm, kv_a_layernorm
    dense_layer = attn + 3 * s + 2  # + gate/up/down, two layer norms
    moe_layer = attn + 2 + 2 + 3 * s * shared + 3 * s * experts  # norms, router + bias, experts
    return dense * dense_layer + (layers - dense) * moe_layer + mtp * (moe_layer + 4) + 3


def qwen3_moe_tensors(layers: int, experts: int) -> int:
    """Tensors in a Qwen3-MoE checkpoint: q, k, v, o, q/k norms, router, experts, two norms."""
    return layers * (4 + 2 + 1 + 3 * experts + 2) + 3


def flat_specs(total_bytes: float, dtype: str, itemsize: int, align: int) -> list[ParamSpec]:
    """The model as one tensor-parallel weight (rows divisible by ``align``) plus a replicated norm:
    enough for per-rank byte counts, which are all pricing needs."""
    hidden = 7168
    rows = int(total_bytes // (hidden * itemsize)) // align * align
    return [ParamSpec("weights", (rows, hidden), dtype, tp_dim=0), ParamSpec("norm", (hidden,), dtype)]


def broadcast_rate(cost: CostModel) -> float:
    """A single-root NCCL broadcast across nodes: channels over every NIC, capped by NVLink."""
    return min(cost.wire_rate(cross_node=True, gpu=True), cost.wire_rate(cross_node=False, gpu=True))


def ours_reshard(
    total: float, dtype: str, itemsize: int, train: dict[str, int], gen: dict[str, int], colocated: bool
) -> tuple[float, float]:
    """Our reshard plan (each receiver gets exactly its shard, senders balanced), priced on H100s."""
    align = math.lcm(train.get("tp", 1), gen.get("tp", 1))
    plan = plan_reshard(flat_specs(total, dtype, itemsize, align), train=train, gen=gen)
    priced = price_reshard(plan, HARDWARE_PROFILES["H100"], gpus_per_node=GPUS, colocated=colocated)
    return priced.predicted_seconds, priced.lower_bound_seconds


def checkpoint_engine(model: str, total: float, tensors: int, published: float) -> Row:
    """checkpoint-engine broadcast mode (``ps.py: _update_per_bucket`` with ``ranks=None``).

    Each of the 256 ranks holds 1/256 of the checkpoint in pinned host memory; with 8 GiB buckets
    that is one bucket per rank. All ranks copy their bucket to the GPU at once, then each bucket
    is broadcast from its owner to all 256 ranks, and every rank's vLLM worker loads it (each
    tensor, keeping its TP16 shard) while the next bucket is broadcast; per bucket a ZeroMQ round
    trip and a barrier. GatherMetas (published separately) is not counted.
    """
    cost = HARDWARE_PROFILES["H20"]
    n = 256
    bucket = total / n
    bcast = total / broadcast_rate(cost)
    reload = tensors * cost.per_tensor_s + total / 16 / cost.load_bytes_per_s
    per_bucket = n * (cost.per_bucket_s + cost.control_round_trip_s)
    predicted = bucket / cost.h2d_bytes_per_s + pipeline_seconds([bcast, reload], n) + per_bucket
    ours, bound = ours_reshard(total, "float8_e4m3fn", 1, {"tp": 256}, {"tp": 16, "dp": 16}, True)
    return Row(
        "checkpoint-engine",
        f"{model} FP8 ({total:.3g} B, {tensors:,} tensors), 256 x H20 (32 nodes), 16 vLLM TP16, colocated",
        (published, published),
        "github.com/MoonshotAI/checkpoint-engine README (commit 415c3205), checkpoint_engine/ps.py",
        predicted,
        ours,
        bound,
        True,
        "H20 nodes with 8 x 400 Gb/s NICs (NVIDIA/nccl-tests#367); their NIC count is not stated",
        {"broadcast": bcast, "reload": reload, "per_bucket": per_bucket},
    )


def verl() -> Row:
    """verl's NCCL checkpoint engine (``nccl_checkpoint_engine.py``) as its README benchmarks it.

    Trainer rank 0 (one of 2 FSDP ranks on node 0) packs tensors one by one into one of two
    3 GiB buckets and broadcasts it to the 30 rollout GPUs (6 on node 0, 24 on nodes 1-3) in one
    NCCL group, with the bucket's metadata over ZeroMQ; receivers yield each tensor and the
    benchmark clones it. Packing bucket i+1 overlaps broadcasting bucket i.
    """
    cost = HARDWARE_PROFILES["H100"]
    total, tensors = 61.1e9, qwen3_moe_tensors(48, 128)
    n = math.ceil(total / (3 * 2**30))
    pack = tensors * cost.per_tensor_s + total / cost.load_bytes_per_s
    wire = total / broadcast_rate(cost)
    unpack = tensors * cost.per_tensor_s + total / cost.load_bytes_per_s
    per_bucket = n * (cost.per_bucket_s + cost.control_round_trip_s)
    predicted = pipeline_seconds([pack, wire, unpack], n) + per_bucket
    topo = Topology.synthetic(4, GPUS)
    workers = [WorkerPlacement(f"train-{i}", "train", "node0", f"gpu{i}") for i in range(2)]
    slots = [(f"node{(k + 2) // 8}", f"gpu{(k + 2) % 8}") for k in range(30)]  # node0 gpu2.. onwards
    workers += [WorkerPlacement(f"eval-{k}", "eval", node, gpu) for k, (node, gpu) in enumerate(slots)]
    plan = plan_transfer(topo, Placement(tuple(workers)), int(total), cost=cost)
    return Row(
        "verl",
        f"Qwen3-30B-A3B bf16 ({total:.3g} B, {tensors:,} tensors), 4x8 H100 400G IB, "
        "FSDP rank 0 -> 30 rollout GPUs",
        (7.0, 7.0),
        "github.com/volcengine/verl verl/checkpoint_engine/README.md, nccl_checkpoint_engine.py, "
        "tests/checkpoint_engine (3 GiB buckets)",
        predicted,
        plan.predicted_seconds,
        plan.lower_bound_seconds,
        True,
        "",
        {"pack": pack, "wire": wire, "unpack": unpack},
    )


def nemo(mode: str) -> Row:
    """NeMo RL, DeepSeek-V3 bf16 on 64x8 H100: 32 training nodes (PP16 x EP16) -> 32 generation
    nodes (vLLM TP32 x DP8), recipe grpo-deepseek-v3-64n8g-async-1off.

    broadcast: one NCCL group of every rank; buckets of min(2% of 80 GB, 5 GiB) packed by their
    owning training rank and broadcast from it, two buffers on separate streams; every
    generation rank loads every tensor (its TP slice). nccl_reshard: each generation rank gets
    exactly its TP32 shard point to point (one group per pipeline stage), then loads its tensors.
    """
    cost = HARDWARE_PROFILES["H100"]
    total, tensors = 1.342e12, deepseek_style_tensors(61, 3, 256, fp8=False)
    load = tensors * cost.per_tensor_s + total / 32 / cost.load_bytes_per_s
    if mode == "broadcast":
        n = math.ceil(total / min(0.02 * 80e9, 5 * 2**30))
        wire = total / broadcast_rate(cost)
        published, source = (14.0, 14.0), "NVIDIA-NeMo/RL PR #1379 (34 s before it)"
    else:
        n = math.ceil(total / 32 / (1.6e9))
        wire = total / 32 / cost.wire_rate(cross_node=True, gpu=True, nics=1)
        published, source = (7.65, 9.94), "NVIDIA-NeMo/RL PRs #2808 and #2413"
    predicted = pipeline_seconds([wire, load], n) + n * cost.per_bucket_s
    train, gen = {"tp": 16, "pp": 1, "dp": 16}, {"tp": 32, "dp": 8}
    ours, bound = ours_reshard(total, "bfloat16", 2, train, gen, False)
    return Row(
        "NeMo RL",
        f"DeepSeek-V3 bf16 ({total:.4g} B, {tensors:,} tensors), 64x8 H100, PP16xEP16 -> TP32xDP8, {mode}",
        published,
        source,
        predicted,
        ours,
        bound,
        True,
        "the training side is priced as 256 ranks each holding 1/16 of every tensor (EP16 spread "
        "over 16 data-parallel groups), which sets the senders, not the receivers' needs",
        {"wire": wire, "load": load},
    )


def perplexity() -> Row:
    """Perplexity's RDMA WRITE transfer: Kimi-K2, 256 training GPUs (BF16) -> 128 inference GPUs
    (FP8). Every training GPU gathers (full_tensor), fuses, quantises and RDMA-writes its share of
    the tensors straight into the inference GPUs' weights (nothing runs on the receivers),
    stages overlapped; a global barrier at the end."""
    cost = HARDWARE_PROFILES["H100"]
    total, tensors = 1.0e12, deepseek_style_tensors(61, 1, 384, fp8=False)
    need = total / 16
    sender_work = tensors / 256 * cost.per_tensor_s
    wire = need / cost.wire_rate(cross_node=True, gpu=True, nics=1)
    predicted = pipeline_seconds([sender_work, wire], max(1, tensors // 256)) + cost.control_round_trip_s
    ours, bound = ours_reshard(total, "float8_e4m3fn", 1, {"tp": 256}, {"tp": 16, "dp": 8}, False)
    return Row(
        "Perplexity",
        f"Kimi-K2 ({total:.3g} B FP8 on the inference side), 256 training GPUs -> 128 inference GPUs, RDMA",
        (1.3, 1.3),
        "research.perplexity.ai, 'Weight transfer for RL post-training in under 2 seconds'",
        predicted,
        ours,
        bound,
        False,
        "H100-class GPUs with a 400 Gb/s NIC each; inference replicas of 16 GPUs (the smallest "
        "that holds 1.0e12 B in 80 GB GPUs; not stated)",
        {"sender_work": sender_work, "wire": wire},
    )


def awex(label: str, total: float, published: float, gen_tp: int) -> Row:
    """Awex's deterministic point-to-point plan: each inference rank receives only its shard (NCCL
    send/recv) and updates in place. Cluster shape, parallelism and tensor counts are not
    published, so only the wire is priced, on an assumed layout."""
    cost = HARDWARE_PROFILES["H100"]
    wire = total / gen_tp / cost.wire_rate(cross_node=True, gpu=True, nics=1)
    predicted = wire + 2 * cost.control_round_trip_s
    ours, bound = ours_reshard(total, "bfloat16", 2, {"tp": 8, "dp": 8}, {"tp": gen_tp, "dp": 2}, False)
    return Row(
        "Awex",
        f"{label} ({total:.3g} B), NCCL",
        (published, published),
        "github.com/inclusionAI/Awex README, 'Performance Benchmarks'",
        predicted,
        ours,
        bound,
        False,
        f"H100 nodes, 400 Gb/s NIC per GPU, training TP8 x DP8, inference TP{gen_tp} x 2 replicas; "
        "no per-tensor term "
        "(tensor counts unpublished): a floor, not a prediction",
        {"wire": wire},
    )


# -- section 3 of the state-of-the-art notes: sharded point-to-point and delta syncs ---------------
QWEN3_235B = 470e9  # bf16: 94 layers, hidden 4096, 128 experts of 3 x 4096 x 1536, 151,936 tokens
QWEN3_235B_EXPERTS = 454e9  # the experts' share of it (94 x 128 x 3 x 4096 x 1536 x 2 B)


def moe_rank_tensors(layers: int, dense_per_layer: int, experts_here: int, per_expert: int = 3) -> int:
    """Tensors one expert-parallel rank loads: every layer's non-expert tensors and its experts'."""
    return layers * (dense_per_layer + per_expert * experts_here)


def verl_delta() -> Row:
    """verl ``delta_sharded`` (NCCL), Qwen3-235B-A22B: 64 training ranks (veomni EP8 x FSDP8, 8
    nodes) -> SGLang TP16 (2 nodes), H100. Each rank gathers its FSDP8 group's full tensors over
    NVLink and compares them with the previous version in bf16; the changed elements of every
    tensor go to rank 0, which packs them into flushes and broadcasts each to the 16 SGLang ranks,
    where every rank applies each tensor's delta to its slice, tensor by tensor. Published with
    its delta: 78-702 MB of about 470 GB."""
    cost = HARDWARE_PROFILES["H100"]
    tensors = qwen3_moe_tensors(94, 128)
    delta = 702e6  # the larger published delta
    gather = QWEN3_235B / 8 / cost.wire_rate(cross_node=False, gpu=True)
    trainer = moe_rank_tensors(94, 9, 16) * cost.per_tensor_s
    rank0 = tensors * cost.per_tensor_s + delta / cost.wire_rate(cross_node=True, gpu=True, nics=1)
    wire = delta / broadcast_rate(cost)
    apply = tensors * cost.per_tensor_s + QWEN3_235B / 16 / cost.load_bytes_per_s
    predicted = gather + trainer + rank0 + wire + apply
    ours, bound = ours_reshard(QWEN3_235B, "bfloat16", 2, {"tp": 8, "dp": 8}, {"tp": 16}, False)
    return Row(
        "verl delta",
        f"Qwen3-235B-A22B bf16 deltas ({delta / 1e6:.0f} MB of {QWEN3_235B:.3g} B, {tensors:,} tensors), "
        "64 H100 EP8xFSDP8 -> SGLang TP16",
        (11.4, 14.9),
        "volcengine/verl PR #7085 (delta_sharded; nccl 246-266 s)",
        predicted,
        ours,
        bound,
        True,
        "rank 0's packing, the broadcast and the receivers' apply run one after the other per flush "
        "(NCCL on one stream); ours and the bound are for the full version",
        {"gather": gather, "trainer": trainer, "rank0": rank0, "wire": wire, "apply": apply},
    )


def vllm_rdt(model: str) -> Row:
    """vLLM ``sharded_rdt`` (NIXL pull through Ray RDT): every receiving rank pulls exactly the
    byte ranges of its shard from the training ranks holding them, the pipeline stages one after
    the other (their staging buffers would not fit at once), the layerwise reload applying
    tensors as they land (V3: pipelined)."""
    cost = HARDWARE_PROFILES["H100"]
    nic = cost.wire_rate(cross_node=True, gpu=True, nics=1)
    if model == "Kimi-K2":
        moved, stages, senders_per_stage = 7.9e12, 8, 32  # 4 replicas x 2 TB; TP8 PP8 EP32 on 256 GPUs
        tensors = 61 * 7 + 60 * (5 + 3 * 12)  # a TP32 EP32 rank: attention of 61 layers, 12 experts of 60
        published, setup = (
            7.53,
            "Kimi-K2 bf16 (7.9 TB moved), 256 H100 TP8 PP8 EP32 -> 128 H100 vLLM TP32 EP32",
        )
        train, gen, total = {"tp": 8, "dp": 32}, {"tp": 32, "dp": 4}, 2.0e12
    else:
        per_gpu = QWEN3_235B_EXPERTS / 16 + (QWEN3_235B - QWEN3_235B_EXPERTS)  # DP16 x EP16
        moved, stages, senders_per_stage = 16 * per_gpu, 2, 8  # Megatron TP4 PP2 EP8 on 16 GPUs
        tensors = moe_rank_tensors(94, 9, 8)
        published, setup = 3.49, "Qwen3-235B-A22B bf16, 16 H100 TP4 PP2 EP8 -> vLLM DP16 EP16 (V3)"
        train, gen, total = {"tp": 4, "dp": 4}, {"tp": 16}, QWEN3_235B
    per_stage = moved / stages / (senders_per_stage * nic)
    load = tensors * cost.per_tensor_s
    predicted = stages * per_stage + load / stages
    ours, bound = ours_reshard(total, "bfloat16", 2, train, gen, False)
    return Row(
        "vLLM RDT",
        setup,
        (published, published),
        "vLLM blog 'sharded weight transfer with RDT' (V1-V3; authors' SoL 1.25 s for Kimi-K2)",
        predicted,
        ours,
        bound,
        True,
        "a stage's senders' NICs are the limit (one 400 Gb/s NIC per GPU); the reload of the last "
        "stage's tensors is not hidden; ours: every training rank holding a slice of every tensor "
        "(no stage in series)",
        {"per_stage": per_stage, "load": load},
    )


def sglang_p2p(model: str) -> Row:
    """SGLang/miles RDMA P2P (Mooncake TE, the ``sglang-miles`` branch): each training rank keeps a
    CPU replica of one inference rank's engine shard (about 32 GB for Kimi-K2), so it gathers
    that shard's slices from the other training ranks, copies them to the host and loads them into
    the replica with the engine's loader on the CPU (quantizing where the engine serves FP8), then
    RDMA-writes the replica into its inference rank's GPU memory."""
    cost = HARDWARE_PROFILES["H100"]
    nic = cost.wire_rate(cross_node=True, gpu=True, nics=1)
    if model == "Kimi-K2":
        total, shard, published = 1.0e12, 1.0e12 / 32, 7.23  # FP8, inference TP32 EP32 on 32 nodes
        tensors = 61 * 7 * 2 + 60 * (5 + 3 * 12) * 2  # with a scale beside every FP8 weight
        setup = "Kimi-K2 FP8 (1 TB), 32 train nodes TP8 PP8 CP4 EP32 -> 32 inference nodes TP32 EP32"
        train, gen, dtype, item = {"tp": 8, "dp": 32}, {"tp": 32, "dp": 8}, "float8_e4m3fn", 1
    else:
        total, shard, published = QWEN3_235B, QWEN3_235B / 32, 3.16  # 8 + 8 nodes, inference TP32 EP32
        tensors = moe_rank_tensors(94, 9, 4)
        setup = "Qwen3-235B-A22B bf16, 8 train nodes -> 8 inference nodes TP32 EP32"
        train, gen, dtype, item = {"tp": 8, "dp": 8}, {"tp": 32, "dp": 2}, "bfloat16", 2
    gather = shard / nic
    d2h = shard / cost.d2h_bytes_per_s
    replica = shard / cost.memcpy_bytes_per_s + tensors * cost.per_tensor_s
    write = shard / nic
    predicted = gather + d2h + replica + write
    ours, bound = ours_reshard(total, dtype, item, train, gen, False)
    return Row(
        "SGLang P2P",
        setup,
        (published, published),
        "LMSYS blog on RDMA P2P weight updates (miles; NCCL 53.28 s / 10.75 s before)",
        predicted,
        ours,
        bound,
        True,
        "the CPU replica's load runs at host memcpy speed (10 GB/s) with the engine's per-tensor cost; "
        "the four stages run one after the other; ours: every training rank holding a slice of every "
        "tensor",
        {"gather": gather, "d2h": d2h, "replica": replica, "write": write},
    )


def prime_rl() -> Row:
    """prime-rl NIXL + ModelExpress, GLM-5.2: 64 training H200 -> 32 inference H200. Each inference
    rank pulls its 82.5 GB (published) through its NIC, pipelined with vLLM's recorded loader
    graph applying what landed (#3341); the 'client update' is that pull and apply."""
    cost = HARDWARE_PROFILES["H200"]
    per_gpu = 82.5e9
    tensors = 78 * 7 + 75 * (5 + 3 * 8)  # GLM-5-style MoE at EP32 (assumed: 256 experts, 78 layers)
    pull = per_gpu / cost.wire_rate(cross_node=True, gpu=True, nics=1)
    load = tensors * cost.per_tensor_s + per_gpu / cost.load_bytes_per_s
    buckets = 64
    predicted = (
        pipeline_seconds([pull, load], buckets) + buckets * cost.per_bucket_s + cost.control_round_trip_s
    )
    return Row(
        "prime-rl",
        "GLM-5.2 (82.5 GB per inference GPU), 64 H200 trainers -> 32 H200 vLLM, NIXL pull",
        (2.84, 2.84),
        "PrimeIntellect-ai/prime-rl PR #3341 (client update median; 44.26 GB/s per GPU)",
        predicted,
        predicted,
        per_gpu / cost.inter_node_bytes_per_s,
        True,
        "GLM-5.2's tensor count per rank is not published (a GLM-5-style MoE at EP32 assumed); "
        "ours: the same pull (each receiver already takes exactly its bytes)",
        {"pull": pull, "load": load},
    )


def published_rows() -> list[Row]:
    return [
        checkpoint_engine("Kimi-K2", 1.0e12, deepseek_style_tensors(61, 1, 384, fp8=True), 16.04),
        checkpoint_engine(
            "DeepSeek-V3.1", 6.85e11, deepseek_style_tensors(61, 3, 256, fp8=True, mtp=1), 11.33
        ),
        verl(),
        nemo("broadcast"),
        nemo("nccl_reshard"),
        perplexity(),
        awex("10B", 31e9, 0.8, 8),
        awex("100B", 191e9, 9.0, 8),
        awex("1T FP8", 1000e9, 20.0, 16),
        verl_delta(),
        vllm_rdt("Kimi-K2"),
        vllm_rdt("Qwen3-235B"),
        sglang_p2p("Kimi-K2"),
        sglang_p2p("Qwen3-235B"),
        prime_rl(),
    ]
