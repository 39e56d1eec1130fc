"""Real vLLM workers on the CPU for `test_vllm.py`: one process per tensor-parallel rank.

Each process builds vLLM 0.33's own Worker (`CPUWorker`, with the rlfleet worker extension
mixed in as ``worker_extension_cls`` does) around a tiny Qwen2 (a folder holding only a
``config.json``; dummy weights), with ``weight_transfer_config={"backend": "rlfleet"}``: vLLM's
plugin loader registers the backend (our ``vllm.general_plugins`` entry point) and the worker's
``load_model`` builds it through vLLM's factory. The test drives the Worker's own RPC methods the
way ``collective_rpc`` reaches them: every argument and result through vLLM's msgpack encoder
and decoder (the engine-core hop of its multiprocess engine: a dataclass arrives as a dict).

Deviations from a vLLM deployment, all outside the weight path: the engine-core and executor
processes are not started (they need GPU kernels); ``CPUWorker.__init__`` is skipped (its only
step beyond ``Worker.__init__`` is ``torch.ops._C.init_cpu_memory_env``, absent from the CUDA
wheel); ``init_device`` runs inside ``set_current_vllm_config``, as vLLM's worker wrapper does.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import contextlib
import hashlib
import itertools
import math
import multiprocessing as mp
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def write_config(root: str, tied: bool) -> str:
    """A folder holding only a tiny Qwen2's ``config.json`` (transformers' `Qwen2Config`)."""
    from transformers import Qwen2Config

    folder = tempfile.mkdtemp(prefix=f"qwen2_{'tied' if tied else 'untied'}_", dir=root)
    config = Qwen2Config(**TINY, tie_word_embeddings=tied)
    config.architectures = ["Qwen2ForCausalLM"]
    config.save_pretrained(folder)
    return folder


def trainer_model(model_dir: str) -> torch.nn.Module:
    """The trainer's model: transformers' Qwen2 (float32, checkpoint names)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config.from_pretrained(model_dir)).eval()


def checkpoint(model_dir: str, version: int) -> dict[str, torch.Tensor]:
    """Version `version` of the trainer's parameters (its ``named_parameters``: a tied model has no
    ``lm_head.weight``), different for every version."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    with torch.device("meta"):
        meta = Qwen2ForCausalLM(Qwen2Config.from_pretrained(model_dir))
    g = torch.Generator().manual_seed(version)
    return {n: torch.randn(tuple(p.shape), generator=g) for n, p in meta.named_parameters()}


def load_version(model: torch.nn.Module, model_dir: str, version: int) -> None:
    """The trainer's training step, as far as the test cares: its parameters become `version`."""
    state = checkpoint(model_dir, version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[name])


def msgpack_hop(value: Any) -> Any:
    """What vLLM's multiprocess engine hands on: its msgpack encoder, then its generic decoder."""
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(value))


def vllm_config(model_dir: str, dtype: str, tp: int) -> Any:
    from vllm.config import (
        DeviceConfig,
        LoadConfig,
        ModelConfig,
        ParallelConfig,
        VllmConfig,
        WeightTransferConfig,
    )

    return VllmConfig(
        model_config=ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype),
        load_config=LoadConfig(load_format="dummy"),
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        weight_transfer_config=WeightTransferConfig(backend="rlfleet"),
    )


class Harness:
    """One vLLM worker rank and the operations the test asks of it (``op_*``)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import vllm.plugins
        from vllm.config import set_current_vllm_config
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
        from vllm.v1.worker.cpu_worker import CPUWorker
        from vllm.v1.worker.gpu_worker import Worker
        from vllm_worker_extension import RlfleetWorkerExtension

        vllm.plugins.load_general_plugins()  # what vLLM's worker wrapper does before building a worker
        self.registered = "rlfleet" in WeightTransferEngineFactory._registry
        self.rank, self.spec = spec["rank"], spec
        self.vc = vllm_config(spec["model_dir"], spec["dtype"], spec["tp"])
        cls = type("RlfleetCPUWorker", (CPUWorker, RlfleetWorkerExtension), {})
        worker = cls.__new__(cls)
        Worker.__init__(
            worker,
            self.vc,
            local_rank=self.rank,
            rank=self.rank,
            distributed_init_method=f"tcp://127.0.0.1:{spec['port']}",
            is_driver_worker=self.rank == 0,
        )
        worker.parallel_config.disable_custom_all_reduce = True
        with set_current_vllm_config(self.vc):
            worker.init_device()
        worker.load_model()
        self.worker = worker
        self.model = worker.model_runner.get_model()
        self._reference: Any = None

    @property
    def engine(self) -> Any:
        return self.worker.weight_transfer_engine

    def reference(self, version: int) -> dict[str, torch.Tensor]:
        """What vLLM's own ``load_weights`` makes of `version` (a second model, same rank)."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader import get_model

        if self._reference is None:  # its own config: vLLM names each attention layer once per config
            config = vllm_config(self.spec["model_dir"], self.spec["dtype"], self.spec["tp"])
            with set_current_vllm_config(config):
                self._reference = get_model(vllm_config=config)
        with torch.no_grad():
            self._reference.load_weights(list(checkpoint(self.spec["model_dir"], version).items()))
        return {n: p.detach() for n, p in self._reference.named_parameters()}

    # -- operations ---------------------------------------------------------------------------
    def op_rpc(self, method: str, args: list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> Any:
        """A worker method as ``collective_rpc`` reaches it (arguments and result through msgpack)."""
        args, kwargs = msgpack_hop(list(args or [])), msgpack_hop(dict(kwargs or {}))
        return msgpack_hop(getattr(self.worker, method)(*args, **kwargs))

    def op_status(self) -> dict[str, Any]:
        return {
            "registered": self.registered,
            "engine": type(self.engine).__name__,
            "applied": getattr(self.engine, "applied", None),
            "active": self.worker._weight_update_active,
            "meta": [n for n, p in self.model.named_parameters() if p.is_meta],
        }

    def op_digest(self) -> str:
        h = hashlib.sha256()
        for name, p in self.model.named_parameters():
            h.update(name.encode())
            h.update(
                p.detach().contiguous().view(torch.uint8).numpy().tobytes() if not p.is_meta else b"meta"
            )
        return h.hexdigest()

    def op_check(self, version: int) -> dict[str, Any]:
        """Is the served model bit-exactly what ``load_weights`` makes of `version`?"""
        reference = self.reference(version)
        params = dict(self.model.named_parameters())
        differs = [n for n, t in reference.items() if params[n].is_meta or not torch.equal(params[n], t)]
        return {"exact": not differs and params.keys() == reference.keys(), "differs": differs}

    def op_break_load(self, on: bool) -> None:
        """vLLM's own ``load_weights`` raises at its fifth tensor (or is itself again)."""
        if not on:
            self.model.__dict__.pop("load_weights", None)
            return
        original = type(self.model).load_weights

        def load_weights(weights: Any) -> Any:
            def failing() -> Any:
                for i, item in enumerate(weights):
                    if i == 4:
                        raise RuntimeError("injected load_weights failure")
                    yield item

            return original(self.model, failing())

        self.model.load_weights = load_weights

    def op_fail_update(self, on: bool) -> None:
        """This rank's node-buffer check fails (the other ranks' succeed)."""
        reader = self.engine._reader
        if not on:
            reader.__dict__.pop("check_version", None)
            return

        def check_version(*_: Any, **__: Any) -> int:
            raise RuntimeError(f"injected receive failure on rank {self.rank}")

        reader.check_version = check_version

    def op_map_check(self, versions: list[int], lm_head: bool = False) -> dict[str, Any]:
        """The loader map at this rank: both recorders agree, and the engine's parameters come out
        of the map bit-exactly, from the full tensors and from this rank's slices alone. `lm_head`:
        the trainer also sends an ``lm_head.weight`` of its own (ignored by a tied engine)."""
        from rlfleet.weightsync import record_loader_map

        model_dir = self.spec["model_dir"]

        def checkpoint_with_head(version: int) -> dict[str, torch.Tensor]:
            state = checkpoint(model_dir, version)
            if lm_head and "lm_head.weight" not in state:
                state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1
            return state

        entries = [(n, tuple(t.shape), t.dtype) for n, t in checkpoint_with_head(0).items()]
        by_dispatch = record_loader_map(self.model.load_weights, self.model, entries)
        by_markers = record_loader_map(self.model.load_weights, self.model, entries, method="markers")
        needed = by_dispatch.needed()
        exact_full, exact_slices = [], []
        for version in versions:
            full = checkpoint_with_head(version)
            poisoned = {n: torch.full_like(t, math.nan) for n, t in full.items()}
            for name, box in needed.items():
                index = tuple(slice(a, b) for a, b in box)
                poisoned[name][index] = full[name][index]
            slices = {n: poisoned[n][tuple(slice(a, b) for a, b in box)].clone() for n, box in needed.items()}
            reference = self.reference(version)
            exact_full.append(_same(_assemble(by_dispatch, full), reference))
            exact_slices.append(_same(_assemble(by_dispatch.sliced(), slices), reference))
        return {
            "recorders_agree": sorted(by_dispatch.pieces, key=repr) == sorted(by_markers.pieces, key=repr)
            and by_dispatch.fills == by_markers.fills,
            "exact_full": exact_full,
            "exact_slices": exact_slices,
            "needed": {n: [list(d) for d in box] for n, box in needed.items()},
            "unused": by_dispatch.unused(),
            "uncovered": by_dispatch.uncovered(),
        }


def _assemble(loader_map: Any, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    stage = loader_map.assemble()
    out = {name: t for n, w in weights.items() if n in loader_map.sources for name, t in stage.feed(n, w)}
    list(stage.finish())
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def serve(conn: Connection, spec: dict[str, Any]) -> None:
    """A rank's process: build the worker, then answer ``(id, op, kwargs)`` until None."""
    try:
        harness = Harness(spec)
    except BaseException as exc:
        conn.send((-1, "error", type(exc).__name__, f"{exc}\n{traceback.format_exc()}"))
        return
    conn.send((-1, "ok", "ready"))
    while True:
        message = conn.recv()
        if message is None:
            return
        call_id, op, kwargs = message
        try:
            conn.send((call_id, "ok", getattr(harness, f"op_{op}")(**kwargs)))
        except BaseException as exc:
            conn.send((call_id, "error", type(exc).__name__, str(exc)))


class WorkerError(Exception):
    """A rank's operation raised; `rank`, `kind` (the exception's type name) and the message."""

    def __init__(self, rank: int, kind: str, message: str) -> None:
        super().__init__(f"rank {rank}: {kind}: {message}")
        self.rank, self.kind, self.message = rank, kind, message


class Ranks:
    """The test's handle on the processes of one vLLM engine (one per tensor-parallel rank)."""

    def __init__(self, model_dir: str, dtype: str, tp: int, port: int, timeout_s: float = 600.0) -> None:
        ctx = mp.get_context("spawn")
        self.tp, self.model_dir, self.dtype = tp, model_dir, dtype
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one call at a time: a caller's thread never reads another's replies
        for rank in range(tp):
            parent, child = ctx.Pipe()
            spec = {"rank": rank, "tp": tp, "model_dir": model_dir, "dtype": dtype, "port": port}
            proc = ctx.Process(target=serve, args=(child, spec), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for rank, conn in enumerate(self.conns):
            if not conn.poll(timeout_s):
                raise TimeoutError(f"vLLM worker rank {rank} not built within {timeout_s}s")
            reply = conn.recv()
            if reply[1] != "ok":
                self.close()
                raise WorkerError(rank, reply[2], reply[3])

    def replies(
        self, op: str, timeout_s: float = 300.0, ranks: list[int] | None = None, **kwargs: Any
    ) -> list[Any]:
        """Send `op` to every rank at once; each rank's value, or its `WorkerError`."""
        ranks = list(range(self.tp)) if ranks is None else ranks
        if not self._lock.acquire(timeout=timeout_s):
            raise TimeoutError(f"{op}: another call held the workers for {timeout_s}s")
        try:
            return self._replies(op, timeout_s, ranks, kwargs)
        finally:
            self._lock.release()

    def _replies(self, op: str, timeout_s: float, ranks: list[int], kwargs: dict[str, Any]) -> list[Any]:
        call_id = next(self._ids)
        for rank in ranks:
            self.conns[rank].send((call_id, op, kwargs))
        out: dict[int, Any] = {}
        while len(out) < len(ranks):
            ready = wait([self.conns[r] for r in ranks if r not in out], timeout_s)
            if not ready:
                raise TimeoutError(
                    f"{op}: ranks {sorted(set(ranks) - set(out))} did not answer in {timeout_s}s"
                )
            for conn in ready:
                rank = self.conns.index(conn)  # type: ignore[arg-type]
                reply = conn.recv()  # type: ignore[union-attr]
                if reply[0] != call_id:
                    continue  # the late answer to an earlier call that was given up on
                out[rank] = reply[2] if reply[1] == "ok" else WorkerError(rank, reply[2], reply[3])
        return [out[r] for r in ranks]

    def each(self, op: str, timeout_s: float = 300.0, **kwargs: Any) -> list[Any]:
        """Every rank's value; the first rank's error raised."""
        results = self.replies(op, timeout_s, **kwargs)
        for result in results:
            if isinstance(result, WorkerError):
                raise result
        return results

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)


class Client:
    """vLLM's ``VLLMWeightSyncClient`` over `Ranks`, as ``LLM`` and its multiprocess engine
    forward each call (``collective_rpc`` to every worker; a failing worker's message in a plain
    ``Exception``, its type lost, as vLLM's engine core raises it)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.weight_version: str | None = None

    def _all(self, method: str, **kwargs: Any) -> None:
        for result in self.ranks.replies("rpc", method=method, kwargs=kwargs):
            if isinstance(result, WorkerError):
                raise Exception(f"Call to collective_rpc method failed: {result.kind}: {result.message}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._all("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update")
        self.weight_version = weight_version


class RpcLLM:
    """``LLM.collective_rpc`` over `Ranks` (for the worker extension), msgpack-encoded both ways;
    a worker's error is raised as soon as it answers, as vLLM's engine core does."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def collective_rpc(
        self,
        method: Any,
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        results = self.ranks.replies(
            "rpc", timeout or 300.0, method=method, args=list(args), kwargs=kwargs or {}
        )
        for result in results:
            if isinstance(result, WorkerError):
                raise Exception(f"Call to collective_rpc method failed: {result.kind}: {result.message}")
        return results
