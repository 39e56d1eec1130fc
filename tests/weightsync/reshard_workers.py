"""Process bodies and a naive reference planner for the reshard execution tests.

The weightsync suite runs without rlfleet.placement, so the rank programs here come from a
deliberately simple planner (first data-parallel replica that holds a chunk, no striping): an
independent oracle for the executor. Shards are cut with torch.chunk / torch.cat.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pickle
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import weightsync_dist_workers as w
from testkit import outcome

from rlfleet.weightsync import (
    DoubleBuffer,
    PeerGroup,
    RecordingConsumer,
    ReshardReceiver,
    ReshardSender,
    checksum,
)

BUCKET = 8 * 1024
DIRECT_MIN = 4 * 1024
DEADLINE = 30.0


# -- models and reference sharding --------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    tp_dim: int | None = None
    layer: int | None = None
    stage: str = "first"
    parts: tuple[tuple[str, int], ...] | None = None

    @property
    def dim(self) -> int:
        return self.tp_dim if self.tp_dim is not None else 0

    @property
    def pieces(self) -> tuple[tuple[str, int], ...]:
        return self.parts or ((self.name, self.shape[self.dim] if self.shape else 1),)


@dataclass(frozen=True)
class Par:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp: int, pp: int, dp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        return rank % self.tp, rank // (self.tp * self.dp), (rank // self.tp) % self.dp


H, Q, KV, F, V, LAYERS = 64, 64, 32, 128, 256, 2


def model(fused: bool = True) -> list[Spec]:
    specs = [Spec("embed", (V, H), tp_dim=0, stage="first")]
    for i in range(LAYERS):
        p = f"layers.{i}"
        if fused:
            specs.append(
                Spec(
                    f"{p}.qkv",
                    (Q + 2 * KV, H),
                    tp_dim=0,
                    layer=i,
                    parts=((f"{p}.q", Q), (f"{p}.k", KV), (f"{p}.v", KV)),
                )
            )
            specs.append(
                Spec(f"{p}.gate_up", (2 * F, H), tp_dim=0, layer=i, parts=((f"{p}.gate", F), (f"{p}.up", F)))
            )
        else:
            specs += [
                Spec(f"{p}.q", (Q, H), tp_dim=0, layer=i),
                Spec(f"{p}.k", (KV, H), tp_dim=0, layer=i),
                Spec(f"{p}.v", (KV, H), tp_dim=0, layer=i),
                Spec(f"{p}.gate", (F, H), tp_dim=0, layer=i),
                Spec(f"{p}.up", (F, H), tp_dim=0, layer=i),
            ]
        specs += [
            Spec(f"{p}.o", (H, Q), tp_dim=1, layer=i),
            Spec(f"{p}.down", (H, F), tp_dim=1, layer=i),
            Spec(f"{p}.norm", (H,), "float32", layer=i),
        ]
    specs += [
        Spec("final_norm", (H,), "float32", stage="last"),
        Spec("head", (V, H), tp_dim=0, stage="last"),
        Spec("step", (), "int64", stage="all"),
    ]
    return specs


def piece_shape(spec: Spec, size: int) -> list[int]:
    """The shape of a piece of `spec` that is `size` long along the spec's concatenation dim."""
    shape = list(spec.shape)
    if shape:
        shape[spec.dim] = size
    return shape


def full_pieces(specs: Sequence[Spec], version: int) -> dict[str, torch.Tensor]:
    """The unsharded model of `version`, piece by piece."""
    g = torch.Generator().manual_seed(7000 + version)
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        for piece, size in spec.pieces:
            shape = piece_shape(spec, size)
            dtype = getattr(torch, spec.dtype)
            if dtype.is_floating_point:
                out[piece] = torch.randn(shape, generator=g).to(dtype)
            else:
                out[piece] = torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)
    return out


def stages(spec: Spec, par: Par) -> tuple[int, ...]:
    if spec.layer is not None:
        base, extra = divmod(LAYERS, par.pp)
        counts = [base + (1 if s < extra else 0) for s in range(par.pp)]
        bounds = [sum(counts[:s]) for s in range(par.pp + 1)]
        return tuple(s for s in range(par.pp) if bounds[s] <= spec.layer < bounds[s + 1])
    return {"first": (0,), "last": (par.pp - 1,), "all": tuple(range(par.pp))}[spec.stage]


def split(spec: Spec, par: Par) -> bool:
    return spec.tp_dim is not None and par.tp > 1


def shard(spec: Spec, pieces: Mapping[str, torch.Tensor], par: Par, tp_rank: int) -> torch.Tensor:
    if not spec.shape:
        return pieces[spec.name].clone()
    chunks = [
        pieces[p].chunk(par.tp, spec.dim)[tp_rank] if split(spec, par) else pieces[p] for p, _ in spec.pieces
    ]
    return torch.cat(chunks, spec.dim).contiguous()


def local_state(
    specs: Sequence[Spec], pieces: Mapping[str, torch.Tensor], par: Par, rank: int
) -> dict[str, torch.Tensor]:
    tp_rank, pp_rank, _ = par.coords(rank)
    return {s.name: shard(s, pieces, par, tp_rank) for s in specs if pp_rank in stages(s, par)}


def assemble(
    specs: Sequence[Spec], par: Par, shards: Mapping[int, Mapping[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    """Rebuild every piece from the generation shards (data-parallel replica 0 of each tp rank)."""
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        stage = stages(spec, par)[0]
        ranks = [par.rank(t, stage, 0) for t in range(par.tp if split(spec, par) else 1)]
        locals_ = [shards[r][spec.name] for r in ranks]
        if not spec.shape:
            out[spec.name] = locals_[0]
            continue
        offset = 0
        for piece, size in spec.pieces:
            step = size // len(ranks)
            out[piece] = torch.cat(
                [t.narrow(spec.dim, offset // len(ranks), step) for t in locals_], spec.dim
            )
            offset += size
    return out


def encode(tensors: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, list[int], bytes]]:
    """Plain bytes for the result queue (tensors would travel as shared memory that dies with us)."""
    return {
        k: (
            str(v.dtype).removeprefix("torch."),
            list(v.shape),
            v.reshape(-1).view(torch.uint8).numpy().tobytes(),
        )
        for k, v in tensors.items()
    }


def decode(data: Mapping[str, tuple[str, list[int], bytes]]) -> dict[str, torch.Tensor]:
    return {
        k: torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
        if raw
        else torch.zeros(shape, dtype=getattr(torch, dtype))
        for k, (dtype, shape, raw) in data.items()
    }


# -- the naive planner --------------------------------------------------------------------------
def programs(
    train_specs: Sequence[Spec], gen_specs: Sequence[Spec], train: Par, gen: Par
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    owner: dict[str, tuple[Spec, int]] = {}
    for spec in train_specs:
        offset = 0
        for piece, size in spec.pieces:
            owner[piece] = (spec, offset)
            offset += size
    transfers: list[list[Any]] = []
    for g in range(gen.world):
        gt, gs, _ = gen.coords(g)
        for spec in gen_specs:
            if gs not in stages(spec, gen):
                continue
            goff = 0
            for piece, size in spec.pieces:
                gsplit = split(spec, gen)
                glo, ghi = (gt * size // gen.tp, (gt + 1) * size // gen.tp) if gsplit else (0, size)
                gloc = goff // gen.tp if gsplit else goff
                tspec, toff = owner[piece]
                tsplit = split(tspec, train)
                tstage = stages(tspec, train)[0]
                for tt in range(train.tp if tsplit else 1):
                    tlo, thi = (tt * size // train.tp, (tt + 1) * size // train.tp) if tsplit else (0, size)
                    a, b = max(glo, tlo), min(ghi, thi)
                    if a >= b:
                        continue
                    src = train.rank(tt if tsplit else g % train.tp, tstage, g % train.dp)
                    row = math.prod(spec.shape) // spec.shape[spec.dim] if spec.shape else 1
                    nbytes = (b - a) * row * getattr(torch, spec.dtype).itemsize
                    src_offset = (toff // train.tp if tsplit else toff) + a - tlo
                    dim = spec.dim if spec.shape else None
                    transfers.append(
                        [
                            src,
                            g,
                            tspec.name,
                            spec.name,
                            dim,
                            src_offset,
                            gloc + a - glo,
                            b - a,
                            nbytes,
                            spec.dtype,
                        ]
                    )
                goff += size

    def tensors(specs: Sequence[Spec], par: Par, rank: int) -> list[list[Any]]:
        pp_rank = par.coords(rank)[1]
        out = []
        for s in specs:
            if pp_rank in stages(s, par):
                shape = list(s.shape)
                if split(s, par):
                    shape[s.dim] //= par.tp
                out.append([s.name, shape, s.dtype])
        return out

    digest = hashlib.sha256(json.dumps(transfers).encode()).hexdigest()

    def program(role: str, rank: int, par: Par, specs: Sequence[Spec]) -> dict[str, Any]:
        mine = [t for t in transfers if t[0 if role == "train" else 1] == rank]
        return {
            "format": 1,
            "digest": digest,
            "role": role,
            "rank": rank,
            "train_world_size": train.world,
            "gen_world_size": gen.world,
            "tensors": tensors(specs, par, rank),
            "transfers": mine,
        }

    return (
        [program("train", r, train, train_specs) for r in range(train.world)],
        [program("gen", g, gen, gen_specs) for g in range(gen.world)],
    )


# -- scenarios ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    train: Par
    gen: Par
    fused_train: bool = True
    fused_gen: bool = True
    per_stage: bool = False
    offset: int = 0  # world rank of training rank 0 (generation ranks follow the training ranks)


CASES = [
    Case("tp2_to_tp1", Par(tp=2), Par(tp=1)),
    Case("tp1_to_tp2", Par(tp=1), Par(tp=2)),
    Case("tp2dp2_to_tp4", Par(tp=2, dp=2), Par(tp=4)),
    Case("pp2_to_pp1", Par(pp=2), Par(pp=1), per_stage=True),
    Case("fused_qkv", Par(tp=2), Par(tp=2), fused_train=False, fused_gen=True),
]


def make_groups(case: Case, rank: int) -> list[PeerGroup] | None:
    """Every process calls this for every case in the same order (dist.new_group's rule)."""
    T, G, o = case.train.world, case.gen.world, case.offset
    if not case.per_stage:
        group = dist.new_group(list(range(o, o + T + G)))
        return [PeerGroup.world(group, T, G)] if o <= rank < o + T + G else None
    out = []
    for s in range(case.train.pp):
        train_ranks = [r for r in range(T) if case.train.coords(r)[1] == s]
        group = dist.new_group([o + r for r in train_ranks] + [o + T + g for g in range(G)])
        if o <= rank < o + T + G and (rank - o in train_ranks or rank - o >= T):
            out.append(PeerGroup.stage(group, train_ranks, G, key=s))
    return out or None


def run_case(
    case: Case, groups: list[PeerGroup], rank: int, steps: Sequence[tuple[str, int, str]]
) -> dict[str, Any]:
    """Run `steps` = (label, version, fault) for this rank; fault names what this rank does wrong."""
    T = case.train.world
    rank -= case.offset
    train_specs, gen_specs = model(case.fused_train), model(case.fused_gen)
    train_progs, gen_progs = programs(train_specs, gen_specs, case.train, case.gen)
    out: dict[str, Any] = {"role": "train" if rank < T else "gen"}
    if rank < T:
        sender = ReshardSender(train_progs[rank], groups, bucket_bytes=BUCKET, direct_min=DIRECT_MIN)
        for label, version, fault in steps:
            state: Mapping[str, torch.Tensor] = local_state(
                train_specs, full_pieces(train_specs, version), case.train, rank
            )
            if fault.startswith(f"train{rank}:"):
                action = fault.split(":")[1]
                name = "embed" if "embed" in state else next(iter(state))
                state = w.FlakyMapping(state, name, 1, action, seconds=4.0)
            deadline = 8.0 if fault else DEADLINE
            extras: dict[str, Any] = {"kv_scales": {"k": 0.5}}
            if fault == f"train{rank}:extras":
                extras = {"not json": object()}
            out[label] = outcome(
                lambda s=state, v=version, d=deadline, e=extras: sender.send(s, v, d, e).nbytes
            )
        out["broken"] = sender.broken
        return out
    g = rank - T
    prog = gen_progs[g]
    receiver = ReshardReceiver(prog, groups, bucket_bytes=BUCKET, direct_min=DIRECT_MIN)
    live = local_state(gen_specs, full_pieces(gen_specs, 0), case.gen, g)
    layout = receiver.program.layout(BUCKET)
    consumer: Any = DoubleBuffer(live, layout)
    if g == 1:  # offers its staging as the landing zone (BucketTarget) and applies to its own weights
        consumer = RecordingConsumer(layout, live, bucket_targets=True)
        live = consumer.weights
    for label, version, fault in steps:
        before = checksum(live)
        target = consumer
        if fault == f"gen{g}:layout":
            bad = dict(live)
            bad["head"] = torch.zeros(3, dtype=torch.bfloat16) if "head" in bad else torch.zeros(1)
            target = DoubleBuffer(bad)
        deadline = 2.0 if fault.endswith(":sleep") else DEADLINE
        with _stuck_request(consumer, fault == f"gen{g}:stuck"):
            result = outcome(lambda c=target, d=deadline: receiver.receive(c, d).extras)
        expected = local_state(gen_specs, full_pieces(gen_specs, version), case.gen, g)
        result["exact"] = checksum(live) == checksum(expected)
        result["intact"] = checksum(live) == before
        result["applied"] = consumer.version
        out[label] = result
    out["shard"] = encode(live)
    out["broken"] = receiver.broken
    out["landed_in_place"] = len(getattr(consumer, "landed_buckets", ()))
    out["own_bytes"] = sum(t.numel() * t.element_size() for t in live.values())
    out["received_bytes"] = sum(t[8] for t in prog["transfers"])
    return out


@contextlib.contextmanager
def _stuck_request(buffer: Any, stuck: bool) -> Iterator[None]:
    """While the sync runs, a request holds `buffer`'s serving lock past its commit timeout."""
    if not stuck:
        yield
        return
    release, serving = threading.Event(), threading.Event()

    def request() -> None:
        with buffer.serving(DEADLINE):
            serving.set()
            release.wait(DEADLINE)

    thread = threading.Thread(target=request)
    timeout, buffer.commit_timeout_s = buffer.commit_timeout_s, 0.5
    thread.start()
    serving.wait(DEADLINE)
    try:
        yield
    finally:
        release.set()
        thread.join(DEADLINE)
        buffer.commit_timeout_s = timeout


MAIN_STEPS = [
    ("v1", 1, ""),
    ("v2", 2, ""),
    ("stale", 2, ""),
    ("sender_fails", 3, "train1:raise"),
    ("gen_layout", 3, "gen2:layout"),
    ("bad_extras", 3, "train0:extras"),
    ("stuck_request", 3, "gen0:stuck"),
    ("v3", 3, ""),
]


TIMEOUT_CASE = Case("timeout", Par(tp=2), Par(tp=1))
#: World ranks 3 (training rank 0), 4 (training rank 1, killed) and 5 (the generation rank).
LOST_CASE = Case("lost", Par(tp=2), Par(tp=1), offset=3)
LOST_RANK = 4


def scenario_all(rank: int, world: int, port: int, spill: str) -> dict[str, Any]:
    """Every case in one world of 8 processes; the last two fail on purpose (a training rank
    stalls past the deadline; another dies mid-stream, after spilling its earlier results into
    the directory `spill`)."""
    w.init(rank, world, port)
    groups = {case.name: make_groups(case, rank) for case in [*CASES, TIMEOUT_CASE, LOST_CASE]}
    results: dict[str, Any] = {}
    for case in CASES:
        mine = groups[case.name]
        if mine is None:
            continue
        steps = MAIN_STEPS if case.name == "tp2dp2_to_tp4" else [("v1", 1, ""), ("v2", 2, "")]
        results[case.name] = run_case(case, mine, rank, steps)
    mine = groups["timeout"]
    if mine is not None:
        results["timeout"] = run_case(TIMEOUT_CASE, mine, rank, [("v1", 1, ""), ("stall", 2, "train1:sleep")])
    mine = groups["lost"]
    if rank == LOST_RANK:
        with open(os.path.join(spill, f"{rank}.pickle"), "wb") as f:
            pickle.dump(results, f)
    if mine is not None:  # training rank 1 (world rank 4) dies in the middle of version 2
        results["lost"] = run_case(LOST_CASE, mine, rank, [("v1", 1, ""), ("lost", 2, "train1:kill")])
    return results


GPU_CASE = Case("gpu", Par(tp=1), Par(tp=1), fused_train=False, fused_gen=True)


def scenario_gpu(rank: int, world: int, port: int, transport: str) -> dict[str, Any]:
    """Two GPUs: training rank 0 on cuda:0 sends to the generation rank on cuda:1 (train keeps
    q, k, v apart, generation fuses them), over torch's NCCL group or a cupy communicator."""
    from datetime import timedelta

    from rlfleet.weightsync import NcclP2PWire, TorchP2PWire

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    train_specs, gen_specs = model(False), model(True)
    train_progs, gen_progs = programs(train_specs, gen_specs, GPU_CASE.train, GPU_CASE.gen)
    if transport == "torch":
        dist.init_process_group(
            "nccl",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        wire: Any = TorchP2PWire(dist.group.WORLD, device)
    else:
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        wire = NcclP2PWire.create(store, rank, world, device=device, deadline=60.0)
    group = PeerGroup.world(wire, 1, 1)
    out: dict[str, Any] = {}
    for version in (1, 2):
        if rank == 0:
            state = {
                k: v.to(device)
                for k, v in local_state(
                    train_specs, full_pieces(train_specs, version), GPU_CASE.train, 0
                ).items()
            }
            sender = out.setdefault(
                "sender", ReshardSender(train_progs[0], group, bucket_bytes=BUCKET, direct_min=DIRECT_MIN)
            )
            out[f"v{version}"] = outcome(lambda s=state, v=version, x=sender: x.send(s, v, DEADLINE).nbytes)
        else:
            if "receiver" not in out:
                out["receiver"] = ReshardReceiver(
                    gen_progs[0], group, bucket_bytes=BUCKET, direct_min=DIRECT_MIN
                )
                out["live"] = {
                    k: v.to(device)
                    for k, v in local_state(gen_specs, full_pieces(gen_specs, 0), GPU_CASE.gen, 0).items()
                }
                out["consumer"] = DoubleBuffer(out["live"], out["receiver"].program.layout(BUCKET))
            out[f"v{version}"] = outcome(
                lambda v=version: out["receiver"].receive(out["consumer"], DEADLINE).version
            )
            expected = local_state(gen_specs, full_pieces(gen_specs, version), GPU_CASE.gen, 0)
            out[f"v{version}"]["exact"] = checksum(out["live"]) == checksum(expected)
    return {k: v for k, v in out.items() if k.startswith("v")}
