"""The vLLM and SGLang recipes (examples/integrations) driven against stand-in engines.

The stand-ins implement the recipes' engine Protocols (`engines.py`) with the behaviour that
matters to a sync: a model whose ``load_weights`` stacks q/k/v and gate/up into its own
parameters from checkpoint names, as vLLM's Llama does; a ``collective_rpc`` that encodes its
arguments and results the way vLLM's multiprocess engine does (msgpack: a dataclass arrives as a
dict, a tuple as a list) and answers a worker's error at once; an engine whose calls answer
``(success, message)``. The rlfleet side runs for real: member groups, broadcasts, two-phase
commits, deadlines. The vLLM recipe also runs against the real vLLM (`test_vllm.py`, ``-m vllm``).
"""

from __future__ import annotations

import dataclasses
import io
import json
import multiprocessing as mp
import pickle
import sys
import threading
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "integrations"))

from sglang_refit import push_distributed, sglang_bucket_consumer, sglang_consumer
from vllm_worker_extension import JoinOptions, RlfleetWorkerExtension, VllmSync

from rlfleet.weightsync import (
    LLAMA_STACKED_PARAMS,
    Fuse,
    Layout,
    SharedBuffer,
    SharedBufferReader,
    apply_transforms,
    checksum,
    host_store,
)

HIDDEN, Q, KV, INTER = 16, 16, 8, 24


def checkpoint(version: int, layers: int = 2) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names, float32, different for every version."""
    g = torch.Generator().manual_seed(version)
    sd: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(32, HIDDEN, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name, shape in (
            ("self_attn.q_proj", (Q, HIDDEN)),
            ("self_attn.k_proj", (KV, HIDDEN)),
            ("self_attn.v_proj", (KV, HIDDEN)),
            ("self_attn.o_proj", (HIDDEN, Q)),
            ("mlp.gate_proj", (INTER, HIDDEN)),
            ("mlp.up_proj", (INTER, HIDDEN)),
            ("mlp.down_proj", (HIDDEN, INTER)),
        ):
            sd[f"{p}{name}.weight"] = torch.randn(*shape, generator=g)
    return sd


def stacked(version: int) -> dict[str, torch.Tensor]:
    """What the engine must hold after loading `version` (rlfleet's own Fuse, as the reference)."""
    return dict(apply_transforms([Fuse()], checkpoint(version).items()))


class StandInLlama(nn.Module):
    """Stacked parameters; ``load_weights`` places each checkpoint shard at its offset."""

    SHARDS: ClassVar[dict[str | int, tuple[int, int]]] = {
        "q": (0, Q),
        "k": (Q, KV),
        "v": (Q + KV, KV),
        0: (0, INTER),
        1: (INTER, INTER),
    }

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterDict(
            {n.replace(".", "__"): nn.Parameter(torch.zeros_like(t), False) for n, t in stacked(0).items()}
        )
        self.loads = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = {k.replace("__", "."): p for k, p in self.weights.items()}
        loaded: set[str] = set()
        for name, tensor in weights:
            for stack, shard, shard_id in LLAMA_STACKED_PARAMS:
                if shard in name:
                    target = name.replace(shard, stack)
                    start, size = self.SHARDS[shard_id]
                    params[target].data[start : start + size].copy_(tensor)
                    break
            else:
                target = name
                params[target].data.copy_(tensor)
            loaded.add(target)
        self.loads += 1
        return loaded

    def state(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): p.detach() for k, p in self.weights.items()}


# -- vLLM ------------------------------------------------------------------------------------------
class StandInRunner:
    def __init__(self) -> None:
        self.model = StandInLlama()
        self.model_config: Any = None

    def get_model(self) -> StandInLlama:
        return self.model


class StandInWorker(RlfleetWorkerExtension):
    """A vLLM worker with the extension mixed in (vLLM does this with worker_extension_cls)."""

    def __init__(self, rank: int) -> None:
        self.model_runner = StandInRunner()
        self.device = torch.device("cpu")
        self.rank = rank


def as_msgpack_would(value: Any) -> Any:
    """What vLLM's msgpack hop makes of a value: a dataclass a dict, a tuple a list; other objects
    cannot be encoded (vLLM raises on the caller's side)."""

    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        raise TypeError(f"Object of type {type(obj).__name__} is not serializable")

    return json.loads(json.dumps(value, default=default))


class StandInLLM:
    """``LLM.collective_rpc``: the method on every worker at once, arguments and results encoded as
    vLLM's multiprocess engine encodes them, a worker's error raised as soon as it happens."""

    def __init__(self, workers: list[StandInWorker]) -> None:
        self.workers = workers

    def collective_rpc(self, method: Any, timeout: Any = None, args: Any = (), kwargs: Any = None) -> Any:
        assert isinstance(method, str)
        args, kwargs = as_msgpack_would(list(args)), as_msgpack_would(kwargs or {})
        results: list[Any] = [None] * len(self.workers)
        errors: list[BaseException] = []
        done = threading.Semaphore(0)

        def call(i: int) -> None:
            try:
                results[i] = as_msgpack_would(getattr(self.workers[i], method)(*args, **kwargs))
            except BaseException as exc:
                errors.append(exc)
            done.release()

        for i in range(len(self.workers)):
            threading.Thread(target=call, args=(i,), daemon=True).start()
        for _ in self.workers:
            assert done.acquire(timeout=timeout)
            if errors:  # vLLM: Exception("Call to collective_rpc method failed: ...") at once
                raise Exception(f"Call to collective_rpc method failed: {errors[0]}")
        return results


@pytest.mark.timeout(120)
def test_vllm_worker_extension_loads_every_version_into_every_worker() -> None:
    workers = [StandInWorker(rank) for rank in range(2)]
    layout = Layout.from_state_dict({f"module.{n}": t for n, t in checkpoint(0).items()}, bucket_bytes=4096)
    store = host_store("127.0.0.1", 0)
    session = VllmSync.connect(
        StandInLLM(workers),
        store,
        "127.0.0.1",
        layout,
        workers=2,
        options=JoinOptions(
            timeout_s=60.0,
            backend="gloo",
            rename_prefix=("module.", ""),  # FSDP-style trainer names -> checkpoint names
            reload=False,  # the stand-in is not vLLM's model: its plain load_weights
        ),
    )
    for version in (1, 2):
        session.push({f"module.{n}": t for n, t in checkpoint(version).items()}, version)
        for worker in workers:
            assert checksum(worker.model_runner.model.state()) == checksum(stacked(version))
    # one load_weights call per version (and one dry run at join, which writes nothing)
    assert [w.model_runner.model.loads for w in workers] == [3, 3]


def test_join_options_cross_collective_rpc_as_plain_json() -> None:
    options = JoinOptions(timeout_s=5.0, backend="gloo", rename_prefix=("module.", ""), reload=False)
    encoded = as_msgpack_would(options.to_dict())
    assert encoded["rename_prefix"] == ["module.", ""]
    assert JoinOptions.from_value(encoded) == options
    assert JoinOptions.from_value(as_msgpack_would(options)) == options  # a dataclass arrives as a dict
    with pytest.raises(ValueError, match="unknown field"):
        JoinOptions.from_value({"timeout": 5})
    with pytest.raises(ValueError, match="rename_prefix"):
        JoinOptions.from_value({"rename_prefix": ["a"]})


@pytest.mark.timeout(120)
def test_a_worker_error_reaches_the_trainer_at_once_not_as_a_rendezvous_timeout() -> None:
    workers = [StandInWorker(rank) for rank in range(2)]
    layout = Layout.from_state_dict({f"module.{n}": t for n, t in checkpoint(0).items()}, bucket_bytes=4096)
    store = host_store("127.0.0.1", 0)
    # no rename: the workers' dry run of load_weights meets "module.*" names it does not know
    options = JoinOptions(timeout_s=3600.0, backend="gloo", reload=False)
    with pytest.raises(Exception, match="collective_rpc method failed"):
        VllmSync.connect(StandInLLM(workers), store, "127.0.0.1", layout, workers=2, options=options)


# -- SGLang ----------------------------------------------------------------------------------------
class StandInSglang:
    """``sglang.Engine``'s refit calls over a stand-in model."""

    def __init__(self) -> None:
        self.model = StandInLlama()
        self.flushes = 0
        self.calls = 0
        self.ranks = 0
        self.group: Any = None

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | list[Any],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> tuple[bool, str]:
        self.calls += 1
        if load_format == "flattened_bucket":  # one serialized payload per tensor-parallel rank
            self.ranks = len(named_tensors)
            payload = pickle.loads(named_tensors[0])
            flat = payload["flattened_tensor"]  # as FlattenedTensorBucket.reconstruct_tensors does
            named_tensors = [
                (m.name, flat[m.start_idx : m.end_idx].reshape(m.shape)) for m in payload["metadata"]
            ]
        self.model.load_weights(named_tensors)
        return True, "Succeeded to update model weights."

    def flush_cache(self) -> bool:
        self.flushes += 1
        return True


@pytest.mark.timeout(120)
def test_sglang_tensor_path_one_call_per_bucket_and_one_flush_per_version() -> None:
    layout = Layout.from_state_dict(checkpoint(0), bucket_bytes=4096)
    engine = StandInSglang()
    consumer = sglang_consumer(engine, layout)
    with SharedBuffer(layout, 1) as node, SharedBufferReader.attach(node.name) as reader:
        for version in (1, 2):
            node.publish(checkpoint(version), version)
            reader.copy_version(version, consumer, 30.0)
            assert checksum(engine.model.state()) == checksum(stacked(version))
    assert engine.flushes == 2
    assert 2 < engine.calls <= 2 * len(layout.buckets)  # bucketed: neither one call per tensor nor one


@pytest.mark.timeout(120)
def test_sglang_flattened_buckets_one_call_per_bucket_no_repack() -> None:
    layout = Layout.from_state_dict(checkpoint(0), bucket_bytes=4096)
    engine = StandInSglang()

    def serialize(payload: Any) -> bytes:  # SGLang's MultiprocessingSerializer pickles with ForkingPickler
        buffer = io.BytesIO()
        ForkingPickler(buffer).dump(payload)
        return buffer.getvalue()

    consumer = sglang_bucket_consumer(engine, layout, tp_size=2, serialize=serialize)
    with SharedBuffer(layout, 1) as node, SharedBufferReader.attach(node.name) as reader:
        for version in (1, 2):
            node.publish(checkpoint(version), version)
            reader.copy_version(version, consumer, 30.0)
            assert checksum(engine.model.state()) == checksum(stacked(version))
    assert engine.flushes == 2
    assert engine.ranks == 2
    assert engine.calls == 2 * len(layout.buckets)  # one dtype here: one call per bucket


def _sglang_engine_process(requests: Any, replies: Any, port: int) -> None:
    """The engine's process: joins the trainer's gloo group (what init_weights_update_group does)
    and serves update_weights_from_distributed / flush_cache requests."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    model = StandInLlama()
    while True:
        call, payload = requests.get(timeout=60)
        if call == "stop":
            replies.put(checksum(model.state()))
            return
        if call == "flush_cache":
            replies.put(True)
            continue
        names, dtypes, shapes = payload
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            dist.broadcast(tensor, src=0)
            received.append((name, tensor))
        model.load_weights(received)
        replies.put((True, f"loaded {len(names)}"))


class EngineHandle:
    """The trainer's handle on the engine process (SGLang's HTTP or engine API stands here)."""

    def __init__(self, requests: Any, replies: Any) -> None:
        self.requests, self.replies = requests, replies
        self.lock = threading.Lock()

    def _call(self, call: str, payload: Any = None) -> Any:
        with self.lock:
            self.requests.put((call, payload))
            return self.replies.get(timeout=60)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *_: Any, **__: Any
    ) -> Any:
        return self._call("update", (names, dtypes, shapes))

    def flush_cache(self) -> Any:
        return self._call("flush_cache")

    def update_weights_from_tensor(self, *args: Any, **kwargs: Any) -> Any:  # not used here
        raise NotImplementedError

    def init_weights_update_group(self, *args: Any, **kwargs: Any) -> Any:  # done at process start
        raise NotImplementedError


def _trainer_process(requests: Any, replies: Any, port: int, out: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
    layout = Layout.from_state_dict(checkpoint(0), bucket_bytes=4096)
    engine = EngineHandle(requests, replies)
    push_distributed(engine, layout, checkpoint(3).items(), None, timeout_s=60.0)
    requests.put(("stop", None))
    out.put(replies.get(timeout=60))


@pytest.mark.timeout(120)
def test_sglang_distributed_path_broadcasts_bucket_by_bucket() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    requests, replies, out = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_sglang_engine_process, args=(requests, replies, port)),
        ctx.Process(target=_trainer_process, args=(requests, replies, port, out)),
    ]
    for p in procs:
        p.start()
    try:
        assert out.get(timeout=100) == checksum(stacked(3))
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
