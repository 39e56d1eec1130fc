"""`BasePolicy`: the worker side of a policy group (the seed's worker calls and NeMo RL's surface).

A user subclasses it and supplies the model (`build_model`), the rollout step (`rollout_step`)
and the training step (`train_step`); everything else (communication groups, receiving,
staging and swapping weights, versions, checkpoints, offload, device facts, profiling) is here
and works the same in a local object and in a Ray actor.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import datetime
import enum
import os
import platform
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rlfleet.policygroup._config import PolicyConfig, TrainConfig
from rlfleet.policygroup._errors import CommGroupError, WorkerDiedError
from rlfleet.policygroup._reshard import ReshardWorkerMixin
from rlfleet.policygroup._transport import bind_module, pack_into, state_of
from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    Deadline,
    DirectBuffer,
    DoubleBuffer,
    Layout,
    LayoutMismatchError,
    MemberGroup,
    RendezvousTimeoutError,
    ServingLock,
    ShardedBuffer,
    SharedBuffer,
    SharedBufferReader,
    SyncTimeoutError,
    VersionError,
    check_in,
    checksum,
    cleanup_stale_segments,
    connect_store,
    fingerprint,
    host_store,
    live_tensors,
    new_group_bounded,
    stand_down_armed_watchdogs,
)

_c10d: Any = dist  # TCPStore / PrefixStore / ProcessGroup* are not re-exported for mypy


class PolicyRole(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class ParallelMode(str, enum.Enum):
    """The seed's group kinds (values equal rlfleet.placement's mode names)."""

    GLOBAL = "global"
    INTRA_NODE = "intra_node"
    WEIGHT_TRANSFER = "weight_transfer"
    TRAIN_DATA_PARALLEL = "train_data_parallel"


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]
    except Exception:  # pragma: no cover - ray absent or not connected
        pass
    return "127.0.0.1"


def _host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = page * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return total, int(line.split()[1]) * 1024
    except OSError:
        pass
    return total, page * os.sysconf("SC_AVPHYS_PAGES")


def _was_restarted() -> bool:
    """True in a Ray actor that Ray restarted after its process died."""
    try:
        import ray

        return bool(ray.is_initialized() and ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # pragma: no cover - not in an actor, or an older Ray
        return False


class _Sink:
    """A BucketConsumer that takes a version it already has and drops the bytes."""

    def __init__(self, layout: Layout, version: int) -> None:
        self.layout = layout
        self.version = version - 1

    def begin(self, version: int) -> None:
        pass

    def consume(self, index: int, data: torch.Tensor) -> None:
        pass

    def commit(self, version: int) -> None:
        pass

    def abort(self, error: BaseException) -> None:
        pass


class _DeferredCommit:
    """A BucketConsumer that stages through `inner` and leaves its commit to the eval's swap.

    The broadcast protocol commits every receiver at the end of a transfer; a rolling update
    wants the transfer done everywhere first and each swap later, while that eval is drained.
    """

    def __init__(self, inner: DirectBuffer | DoubleBuffer) -> None:
        self.inner = inner
        self.ready: int | None = None

    @property
    def layout(self) -> Layout:
        return self.inner.layout

    @property
    def version(self) -> int:
        return self.inner.version

    def begin(self, version: int) -> None:
        self.ready = None
        self.inner.begin(version)

    def consume(self, index: int, data: torch.Tensor) -> None:
        self.inner.consume(index, data)

    # the inner buffer's landing zones: a broadcast writes straight into its staging
    def bucket_target(self, index: int) -> torch.Tensor | None:
        return self.inner.bucket_target(index)

    def tensor_target(self, name: str) -> torch.Tensor | None:
        return self.inner.tensor_target(name)

    def commit(self, version: int) -> None:
        self.ready = version

    def abort(self, error: BaseException) -> None:
        self.ready = None
        self.inner.abort(error)


class BasePolicy(ReshardWorkerMixin):
    """A train or eval policy worker; subclass it with a model, a rollout step and a train step.

    Works as a plain object (single process) and as a Ray actor (`ray.remote(cls)`); the policy
    group drives it either way. Eval weights live in flat slots: "None" has one slot written in
    place, "Double" two private slots (serve one, receive into the other, swap by rebinding),
    "Shared" two slots of one shared-memory file per node.
    """

    def __init__(
        self,
        config: PolicyConfig | None = None,
        role: PolicyRole | str = PolicyRole.EVAL,
        seed: int = 0,
        index: int = 0,
        device: str | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.config = config if config is not None else PolicyConfig()
        self.role = PolicyRole(role)
        self.index = index
        self.seed = seed
        torch.manual_seed(seed)
        if device is None:
            device = "cuda" if torch.cuda.is_available() and self._wants_gpu() else "cpu"
        self.device = torch.device(device)
        self.model: torch.nn.Module = self.build_model().to(self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.train_config: TrainConfig | None = None
        self.env_meta: Any = None
        self.eval_config: Any = None
        self.dataset: Any = None
        self.model_update_group: Any = None
        self.pp_comm_group: Any = None
        # serving
        self._serve = ServingLock()
        self._count_lock = threading.Lock()
        self._num_requests = 0
        # distributed
        self._rank = 0
        self._world_size = 1
        self._local_rank = 0
        self._local_world_size = 1
        self._store: Any = None
        self._store_port: int | None = None
        self._groups: dict[str, Any] = {}
        self._groups_by_mode: dict[str, Any] = {}
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        self._mode_ranks: dict[str, tuple[int, ...]] = {}
        self._registered: set[str] = set()  # groups torch.distributed knows (made by every rank)
        self._senders: dict[tuple[str, str], BroadcastSender] = {}
        self._receivers: dict[tuple[str, str], BroadcastReceiver] = {}
        # weights
        self._version = 0
        self._layout: Layout | None = None
        self._strategy = "None"
        self._buffer: DirectBuffer | DoubleBuffer | None = None  # "None" / "Double" (rlfleet.weightsync)
        self._sharded: ShardedBuffer | None = None  # "Sharded": this eval's share of each version
        self._gathered: torch.Tensor | None = None  # "Sharded": the whole model, from the last gather
        self._gather_target: torch.Tensor | None = None
        self._staged: tuple[str, Any, int] | None = None  # (kind, where, version)
        self._send_lock = threading.Lock()  # concurrent sends of one version pack once
        self._shared_writer: SharedBuffer | None = None  # this process fills its node's shared buffer
        self._shared_reader: SharedBufferReader | None = None  # zero-copy views of the node's buffer
        self._node_reader: SharedBufferReader | None = None  # private copies from the node's buffer
        self._shm_prefix: str | None = None  # name prefix of our group's shared buffers (cleanup)
        self._update_done = threading.Event()
        self._update_done.set()
        # bookkeeping
        self._timings: dict[str, list[float]] = {}
        self._save_thread: threading.Thread | None = None
        self._save_error: BaseException | None = None
        self._profiler: Any = None
        self._profile_exec: concurrent.futures.ThreadPoolExecutor | None = None
        self._profile_dir: str | None = None
        self._ref_model: torch.nn.Module | None = None
        self._offloaded: dict[str, bool] = {"model": False, "optimizer": False, "grad": False}
        self._finished = False
        # Ray restarted this actor after a crash (max_restarts): calls queued for the dead process
        # arrive here, where the group's weights are gone, until the group wires us in again
        self._restarted = _was_restarted()

    # ================================================================== user hooks
    def build_model(self) -> torch.nn.Module:
        """Return the policy's model (called once, in the worker)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def rollout_step(self, env_ret: Any) -> Any:
        """One policy response for one environment return (eval policies)."""
        raise NotImplementedError(f"{type(self).__name__} must implement rollout_step(env_ret)")

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        """One optimisation step on `batch` (train policies); returns scalar metrics."""
        raise NotImplementedError(f"{type(self).__name__} must implement train_step(batch)")

    def postprocess_step(self, *args: Any) -> Any:
        """Post-process (env return, policy response); the default returns the last argument."""
        return args[-1] if args else None

    def build_optimizer(self, train_config: TrainConfig | None) -> torch.optim.Optimizer:
        lr = train_config.lr if train_config is not None else 1e-3
        return torch.optim.Adam(self.model.parameters(), lr=lr)

    def policy_logits(self, model: torch.nn.Module, data: Mapping[str, Any]) -> torch.Tensor:
        """Logits of `model` for `data` (default: `model(data["obs"])` or `model(data["input_ids"])`)."""
        x = data["obs"] if "obs" in data else data["input_ids"]
        out: torch.Tensor = model(x.to(self.device))
        return out

    def _wants_gpu(self) -> bool:
        gpus = self.config.train_num_gpus if self.role == PolicyRole.TRAIN else self.config.eval_num_gpus
        return gpus > 0

    # ================================================================== seed lifecycle
    def _timed(self, name: str, start: float) -> None:
        entry = self._timings.setdefault(name, [0.0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - start

    def init_eval(self, eval_config: Any = None, env_meta: Any = None) -> None:
        self.set_role(PolicyRole.EVAL)
        self.eval_config = eval_config
        self.env_meta = env_meta
        self.model.eval()

    def init_train(self, train_config: TrainConfig | None = None, env_meta: Any = None) -> None:
        self.set_role(PolicyRole.TRAIN)
        self.train_config = train_config
        self.env_meta = env_meta
        self.model.train()
        self.optimizer = self.build_optimizer(train_config)
        self._ref_model = None

    def reset_training_state(
        self, train_config: TrainConfig | None = None, env_meta: Any = None, seed: int | None = None
    ) -> None:
        if seed is not None:
            torch.manual_seed(seed)
        self.init_train(train_config if train_config is not None else self.train_config, env_meta)

    def print_timing_summary(self, reset: bool = False) -> dict[str, dict[str, float]]:
        summary = {
            name: {"count": c, "total_s": t, "mean_s": t / c if c else 0.0}
            for name, (c, t) in sorted(self._timings.items())
        }
        for name, s in summary.items():
            print(
                f"[{self.role.value}{self.index}] {name}: n={int(s['count'])} "
                f"total={s['total_s']:.4f}s mean={s['mean_s'] * 1e3:.3f}ms"
            )
        if reset:
            self._timings.clear()
        return summary

    def set_role(self, role: PolicyRole | str, index: int | None = None) -> None:
        """Become a train or eval policy (role conversion); weights are kept."""
        role = PolicyRole(role)
        if index is not None:
            self.index = index
        if role == self.role:
            return
        if role == PolicyRole.TRAIN:
            self._unbind_weights()  # give the trainer private, writable storage
            self.release_weight_buffers()
            self.role = role
            self.model.train()
        else:
            self.role = role
            self.optimizer = None
            self.model.eval()

    def get_role(self) -> str:
        return self.role.value

    # ================================================================== serving
    def _refuse_if_restarted(self) -> None:
        if self._restarted and self.role == PolicyRole.EVAL:
            raise WorkerDiedError(
                f"eval policy {self.index} was restarted after a crash and holds its initial weights "
                "until its group wires it in again (init_weight_buffer); retry on another worker",
                "eval",
                self.index,
            )

    @contextlib.contextmanager
    def _serving(self) -> Iterator[None]:
        """Around a rollout: counted, and never overlapping a weight swap (a swap waits for
        in-flight rollouts and new ones wait for the swap, at most as long as a sync may take)."""
        self._refuse_if_restarted()
        with self._count_lock:
            self._num_requests += 1
        try:
            with self._serve.shared(self.config.sync_timeout_s + self.config.drain_timeout_s):
                yield
        finally:
            with self._count_lock:
                self._num_requests -= 1

    def _rollout(self, env_ret: Any) -> Any:
        start = time.perf_counter()
        try:
            with self._serving(), torch.no_grad():
                return self.rollout_step(env_ret)
        finally:
            self._timed("rollout", start)

    def _rollout_async(self, env_ret: Any) -> Any:
        return self._rollout(env_ret)

    def _rollout_many(self, env_rets: Sequence[Any]) -> Any:
        """Several requests in one call (one Ray task, one return object per request)."""
        start = time.perf_counter()
        try:
            with self._serving(), torch.no_grad():
                out = self.rollout_many_step(list(env_rets))
        finally:
            self._timed("rollout_many", start)
        return out[0] if len(out) == 1 else tuple(out)

    def rollout_many_step(self, env_rets: list[Any]) -> list[Any]:
        """Responses for a list of env returns; override to batch them into one forward pass."""
        return [self.rollout_step(x) for x in env_rets]

    def _postprocess(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.postprocess_step(*args)
        finally:
            self._timed("postprocess", start)

    def get_num_requests(self) -> int:
        return self._num_requests

    # ================================================================== training
    def update_dataset(self, data: Any) -> int:
        self.dataset = data
        return len(data) if hasattr(data, "__len__") else 1

    def train(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self.role != PolicyRole.TRAIN:
            raise RuntimeError(f"train() called on {self.role.value} policy {self.index}")
        if self.optimizer is None:
            self.optimizer = self.build_optimizer(self.train_config)
        start = time.perf_counter()
        batch = args[0] if args else self.dataset
        try:
            return self.train_step(batch, *args[1:], **kwargs)
        finally:
            self._timed("train", start)

    def _ddp_group(self) -> Any:
        return self._groups_by_mode.get(ParallelMode.TRAIN_DATA_PARALLEL.value)

    def allreduce_gradients(self) -> None:
        """Average gradients over the train data-parallel group (call between backward and step)."""
        group = self._ddp_group()
        if group is None:
            return
        size = len(self._mode_ranks[ParallelMode.TRAIN_DATA_PARALLEL.value])
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads or size <= 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if isinstance(group, MemberGroup):
            work = group.process_group.allreduce([flat])
        else:
            work = dist.all_reduce(flat, group=group, async_op=True)
        if not work.wait(timeout=datetime.timedelta(seconds=self.config.group_timeout_s)):
            raise SyncTimeoutError("gradient all-reduce timed out")
        flat.div_(size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    # ================================================================== weights: inspection
    def get_param_fingerprint(self) -> dict[str, float]:
        return fingerprint(state_of(self.model))

    def get_weight_checksum(self) -> str:
        return checksum(state_of(self.model))

    def get_weight_version(self) -> int:
        return self._version

    def set_weight_version(self, version: int) -> None:
        self._version = int(version)

    def get_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in state_of(self.model).items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in state_of(self.model).items():
                tensor.copy_(state[name])

    def get_training_state(self) -> dict[str, Any]:
        """Model and optimizer state (to start a new data-parallel trainer exactly in step)."""
        return {
            "model": self.get_state_dict(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "train_config": self.train_config,
        }

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        """Become a replica of the trainer `state` came from (role must be train already)."""
        self.load_state_dict(state["model"])
        self.train_config = state.get("train_config", self.train_config)
        self.optimizer = self.build_optimizer(self.train_config)
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._ref_model = None

    def get_weight_layout(self, bucket_bytes: int) -> dict[str, Any]:
        return Layout.from_state_dict(state_of(self.model), bucket_bytes).to_dict()

    # ================================================================== weights: buffers
    def init_weight_buffer(
        self,
        shared_weight_buffer: Mapping[str, Any] | None = None,
        *,
        strategy: str | None = None,
        layout: Mapping[str, Any] | None = None,
    ) -> None:
        """Prepare to receive weights with `strategy` ("None", "Double" or "Shared").

        `layout` is the sender's layout (JSON-safe dict); ours must match it exactly (an error
        names the first parameter that differs). `shared_weight_buffer["name"]` names the node's
        shared buffer (weightsync `SharedBuffer`, filled once per version by the node's trainer
        or cross-node receiver): with "Shared" the model binds to it zero-copy at the first swap;
        with the other strategies this worker copies each version out of it into its own buffer
        (layout-checked; checksummed if the group asks). "Sharded" also needs
        ``{"rank": r, "world_size": n}``.
        """
        if strategy is None:
            strategy = (
                "Shared" if shared_weight_buffer is not None else self.config.weight_buffer.buffer_strategy
            )
        if strategy not in ("None", "Double", "Shared", "Sharded"):
            raise ValueError(f"weight buffer strategy {strategy!r} is not supported by {type(self).__name__}")
        bucket_bytes = self.config.weight_buffer.bucket_bytes
        mine = Layout.from_state_dict(
            state_of(self.model), bucket_bytes if layout is None else int(layout["bucket_bytes"])
        )
        if layout is not None:
            theirs = Layout.from_dict(layout)
            try:
                mine.require_same(theirs)
            except LayoutMismatchError as exc:
                raise LayoutMismatchError(
                    f"{self.role.value} policy {self.index}: model does not match the trainer's: {exc}",
                    exc.parameter,
                ) from None
        self._unbind_weights()
        self._restarted = False
        self._layout = mine
        self._strategy = strategy
        self._staged = None
        timeout = self.config.drain_timeout_s
        # rlfleet.weightsync buffers: "None" stages a transient copy and applies it at commit,
        # "Double" keeps a staging copy and swaps storages at commit (no copy on the swap)
        if strategy == "None":
            self._buffer = DirectBuffer(live_tensors(self.model), mine, commit_timeout_s=timeout)
        elif strategy == "Double":
            self._buffer = DoubleBuffer(live_tensors(self.model), mine, mode="swap", commit_timeout_s=timeout)
        elif strategy == "Sharded":  # keep 1/N of each new version; the node's evals gather at the swap
            if shared_weight_buffer is None or "rank" not in shared_weight_buffer:
                raise ValueError("strategy 'Sharded' needs shared_weight_buffer={'rank': r, 'world_size': n}")
            self._sharded = ShardedBuffer(
                mine, int(shared_weight_buffer["rank"]), int(shared_weight_buffer["world_size"])
            )
        name = None if shared_weight_buffer is None else shared_weight_buffer.get("name")
        self._shared_name = None if name is None else str(name)
        if self._shared_name is not None:
            self._shm_prefix = self._shared_name.split("_", 1)[0]
        if strategy == "Shared" and self._shared_name is None:
            raise ValueError("strategy 'Shared' needs shared_weight_buffer={'name': ...}")
        if self._shared_name is not None:
            reader = SharedBufferReader.attach(
                self._shared_name, expected_layout=mine, timeout_s=self.config.group_timeout_s
            )
            if strategy == "Shared":
                reader.bind_module(self.model)  # takes effect at the first refresh (the first swap)
                self._shared_reader = reader
            else:
                self._node_reader = reader

    def _unbind_weights(self) -> None:
        """Give the model private, writable storage again (role change, buffer rebuild)."""
        reader, self._shared_reader = self._shared_reader, None
        node_reader, self._node_reader = self._node_reader, None
        if node_reader is not None:
            node_reader.close()
        buffer, self._buffer = self._buffer, None
        if buffer is not None:
            buffer.abort(RuntimeError("weight buffer released"))
        if self._gathered is not None and self._layout is not None:  # weights are views of a gather
            fresh = torch.empty(self._layout.padded_bytes, dtype=torch.uint8)
            pack_into(self._layout, state_of(self.model), fresh)
            bind_module(self.model, self._layout, fresh)
        self._sharded = None
        self._gathered = None
        if reader is not None and self._layout is not None:
            fresh = torch.empty(self._layout.padded_bytes, dtype=torch.uint8)
            pack_into(self._layout, state_of(self.model), fresh)  # copy out of the read-only mapping
            bind_module(self.model, self._layout, fresh)
        if reader is not None:
            reader.close()

    def release_weight_buffers(self) -> int:
        """Leave the node's shared buffer, unlinking it if this worker wrote it; returns how many unlinked."""
        self._unbind_weights()
        writer, self._shared_writer = self._shared_writer, None
        removed = 0
        if writer is not None:
            writer.close()  # unlinks; bound readers keep their views until they rebind
            removed = 1
        if self._shm_prefix is not None:  # a writer of our group SIGKILLed on this node left its buffer
            removed += len(cleanup_stale_segments(self._shm_prefix))
        self._layout = None if self.role == PolicyRole.TRAIN else self._layout
        return removed

    def _sender_layout(self, bucket_bytes: int) -> Layout:
        if self._layout is None or self._layout.bucket_bytes != bucket_bytes:
            self._layout = Layout.from_state_dict(state_of(self.model), bucket_bytes)
        return self._layout

    # ================================================================== weights: sender
    def create_shared_writer(
        self, layout: Mapping[str, Any], num_readers: int, prefix: str = "rlfleet", checksums: bool = False
    ) -> str:
        """Become the writer of this node's shared buffer (two slots); returns its name for the readers.

        The buffer's layout is the group's (the trainers'); a later publish of a model that no
        longer fits it fails on this side, naming the parameter, before any reader takes bytes.
        """
        if self._shared_writer is not None:
            self._shared_writer.close()
        self._shm_prefix = prefix
        cleanup_stale_segments(prefix)  # the buffer of a writer of this group that was killed here
        self._shared_writer = SharedBuffer(
            Layout.from_dict(layout),
            num_readers,
            timeout_s=self.config.sync_timeout_s,
            prefix=prefix,
            checksums=checksums,
        )
        return self._shared_writer.name

    def _writer(self) -> SharedBuffer:
        if self._shared_writer is None:
            raise RuntimeError(f"{self.role.value} policy {self.index}: not the writer of a shared buffer")
        return self._shared_writer

    def publish_shared(self, version: int, timeout_s: float) -> int:
        """Trainer on the node: write this version once into the node's shared buffer."""
        with self._send_lock:
            writer = self._writer()
            if writer.version < version:  # a retried sync finds it published already
                writer.publish(state_of(self.model), version, Deadline(timeout_s))
        return version

    def _src_in(self, group_id: str, global_rank: int) -> int:
        """How weightsync names the source in `group_id`: the global rank in a world group, the
        member rank in a group its members made alone (`MemberGroup`)."""
        if group_id in self._registered:
            return global_rank
        return self._group_ranks[group_id].index(global_rank)

    def send_broadcast(self, group_id: str, version: int, bucket_bytes: int, timeout_s: float) -> int:
        """Broadcast this trainer's weights in weight-transfer group `group_id` (we are the root).

        weightsync's protocol: layouts negotiated, buckets pipelined, committed by all or none.
        """
        group = self._group(group_id)
        with self._send_lock:
            layout = self._sender_layout(bucket_bytes)
        key = (group_id, layout.digest)
        sender = self._senders.get(key)
        if sender is None:
            sender = self._senders[key] = BroadcastSender(layout, group, self._src_in(group_id, self._rank))
        sender.send(state_of(self.model), version, Deadline(timeout_s))
        return layout.padded_bytes

    def send_weights_ipc(self) -> dict[str, torch.Tensor]:
        """Colocated seed path: a CPU copy of the state dict (travels through the object store)."""
        return self.get_state_dict()

    # ================================================================== weights: receiver
    def _require_layout(self) -> Layout:
        self._refuse_if_restarted()
        if self._layout is None:
            raise RuntimeError(
                f"{self.role.value} policy {self.index}: init_weight_buffer() has not been called"
            )
        return self._layout

    def _have(self, version: int) -> bool:
        """True when `version` is already applied here, or already in the node's shared buffer.

        A sync retried for the survivors of a failure resends the same version: whoever already
        has it takes part (a collective needs everyone) without applying anything twice.
        """
        if version <= self._version:
            return True
        writer = self._shared_writer
        return self._strategy == "Shared" and writer is not None and writer.version >= version

    def _sharded_buffer(self) -> ShardedBuffer:
        if self._sharded is None:
            raise RuntimeError(
                f"{self.role.value} policy {self.index}: no sharded buffer (init_weight_buffer)"
            )
        return self._sharded

    def stage_from_segment(self, name: str, version: int, *_deps: Any) -> int:
        """Take version `version` from this node's shared buffer (written once by a local trainer).

        "Shared" only waits for it (the swap rebinds the views); the other strategies copy it
        out (each bucket checked against the writer's CRC32 when the group turned checksums on).
        """
        self._require_layout()
        self._update_done.clear()
        if self._strategy == "Shared":  # nothing to copy: wait until the node's writer committed it
            reader = self._shared_reader
            if reader is None:
                raise RuntimeError(f"{self.role.value} policy {self.index}: no shared buffer attached")
            reader.check_version(version, Deadline(self.config.sync_timeout_s))  # verified if checksummed
            self._staged = ("shared", name, version)
            return version
        node_reader = self._node_reader
        if node_reader is None or node_reader.name != name:
            raise RuntimeError(
                f"{self.role.value} policy {self.index}: not a reader of shared buffer {name!r} "
                "(init_weight_buffer)"
            )
        if self._have(version):  # a retry: this worker already has it
            self._update_done.set()
            return version
        deadline = Deadline(self.config.sync_timeout_s)
        if self._strategy == "Sharded":  # keep our share, committed: the model still serves its copy
            sharded = self._sharded_buffer()
            if sharded.version < version:
                node_reader.copy_version(version, sharded, deadline)
            self._staged = ("sharded", None, version)
            return version
        if self._buffer is None:
            raise RuntimeError(
                f"{self.role.value} policy {self.index}: init_weight_buffer() has not been called"
            )
        node_reader.copy_version(version, _DeferredCommit(self._buffer), deadline)
        self._staged = ("buffer", None, version)
        if self._strategy == "None":
            self.apply_staged(version)
        return version

    def recv_broadcast(self, group_id: str, src_rank: int, version: int, timeout_s: float) -> int:
        """Receive version `version` from `src_rank` in weight-transfer group `group_id`, then stage it."""
        self._require_layout()
        self._update_done.clear()
        group = self._group(group_id)
        return self._receive_protocol(group_id, group, self._src_in(group_id, src_rank), version, timeout_s)

    def _receive_protocol(
        self, group_id: str, group: Any, src_rank: int, version: int, timeout_s: float
    ) -> int:
        """weightsync's BroadcastReceiver straight into our buffer (no scratch copy); `src_rank`
        as weightsync names it in this group (see `_src_in`)."""
        layout = self._require_layout()
        key = (group_id, layout.digest)
        receiver = self._receivers.get(key)
        if receiver is None:
            receiver = self._receivers[key] = BroadcastReceiver(layout, group, src_rank)
        deadline = Deadline(timeout_s)
        if self._have(version):  # a retry: take part in the collectives, keep what we have
            receiver.receive(_Sink(layout, version), deadline)
            if self._strategy == "Shared" and version > self._version:
                self._staged = ("shared", None, version)
            self._update_done.set()
            return version
        if self._strategy == "Sharded":
            stats = receiver.receive(self._sharded_buffer(), deadline)  # keeps only our buckets
            self._staged = ("sharded", None, stats.version)
        elif self._strategy == "Shared":  # we receive for the node: the node's writer is the consumer
            stats = receiver.receive(self._writer(), deadline)
            self._staged = ("shared", None, stats.version)
        elif self._strategy == "None":  # in place: the group drained us first
            assert self._buffer is not None
            with self._serve.exclusive(timeout_s):
                stats = receiver.receive(self._buffer, deadline)
                self._version = stats.version
                self._staged = None
                self._update_done.set()
        else:
            assert self._buffer is not None
            deferred = _DeferredCommit(self._buffer)
            stats = receiver.receive(deferred, deadline)
            self._staged = ("buffer", None, stats.version)
        if stats.version != version:
            raise VersionError(
                f"{self.role.value} policy {self.index}: expected v{version}, got v{stats.version}"
            )
        return stats.version

    def recv_weights_ipc(self, state: Mapping[str, torch.Tensor], version: int | None = None) -> int:
        """Colocated seed path: load a state dict that came through the object store."""
        with self._serve.exclusive(self.config.drain_timeout_s):
            self.load_state_dict(state)
            self._version = self._version + 1 if version is None else int(version)
        return self._version

    def apply_staged(
        self, version: int | None = None, timeout_s: float | None = None, group_id: str | None = None
    ) -> int:
        """Make the staged version live (a storage swap or a rebind: no copy for Double and Shared)."""
        staged = self._staged
        if staged is None:
            self._update_done.set()
            return self._version
        kind, _, staged_version = staged
        if version is not None and staged_version != version:
            raise VersionError(
                f"{self.role.value} policy {self.index}: asked to apply v{version}, "
                f"staged is v{staged_version}"
            )
        with self._serve.exclusive(self.config.drain_timeout_s if timeout_s is None else timeout_s):
            try:
                if kind == "buffer":
                    assert self._buffer is not None
                    self._buffer.commit(staged_version)
                elif kind == "sharded":  # collective: every eval of the node applies at once
                    if group_id is None:
                        raise RuntimeError("a Sharded swap needs the node's eval group (group_id)")
                    views = self._sharded_buffer().gather(
                        self._group(group_id), Deadline(self.config.drain_timeout_s), out=self._gather_out()
                    )
                    live = live_tensors(self.model)
                    with torch.no_grad():
                        for name, view in views.items():
                            live[name].data = view
                    self._gathered = self._gather_target
                else:
                    assert self._shared_reader is not None
                    self._shared_reader.refresh(Deadline(self.config.drain_timeout_s))
                self._version = staged_version
                self._staged = None
            finally:
                self._update_done.set()  # wakes waiters on success and on failure
        return self._version

    def _gather_out(self) -> torch.Tensor:
        """A fresh buffer for the next gather (the current one still backs the served weights)."""
        sharded = self._sharded_buffer()
        target = torch.empty(sharded.shard_bytes * sharded.world_size, dtype=torch.uint8)
        self._gather_target = target
        return target

    def notify_update_weights(self) -> int:
        """Seed call: new weights are staged; apply them now (the group drains us first)."""
        return self.apply_staged()

    def wait_for_weight_update_done(self, timeout: float = 60.0) -> bool:
        """True once no received version is waiting to be applied (False on timeout)."""
        return self._update_done.wait(timeout) and self._staged is None

    def get_staged_version(self) -> int | None:
        return None if self._staged is None else self._staged[2]

    # ================================================================== distributed
    def _get_node_id(self) -> str:
        try:
            import ray

            if ray.is_initialized():
                return str(ray.get_runtime_context().get_node_id())
        except Exception:  # pragma: no cover
            pass
        return "local"

    def _get_gpu_ids(self) -> list[int]:
        try:
            import ray

            if ray.is_initialized():
                ids = [int(i) for i in ray.get_gpu_ids()]
                if ids:
                    return ids
        except Exception:  # pragma: no cover
            pass
        return [0]

    def _get_addr_and_port(self, host: str | None = None) -> tuple[str, int]:
        """Host a fresh rendezvous store here (the would-be rank 0) and return its address.

        `host` overrides the node's address (127.0.0.1 when every node is on this machine).
        """
        ip = host or _node_ip()
        self._close_store()
        # listens on `ip` only: torch's own master would listen on every interface
        self._store = host_store(ip, 0, timeout_s=self.config.group_timeout_s)
        self._store_port = int(self._store.port)
        return ip, self._store_port

    def _close_store(self) -> None:
        self._store = None
        self._store_port = None

    def _destroy_groups(self) -> None:
        self._groups.clear()
        self._groups_by_mode.clear()
        self._group_ranks.clear()
        self._mode_ranks.clear()
        self._registered.clear()
        self._senders.clear()
        self._receivers.clear()
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # best effort
                dist.destroy_process_group()

    def _join(
        self, store: Any, prefix: str, rank: int, ranks: Sequence[int], timeout_s: float, what: str
    ) -> None:
        """Everyone announces itself; a rank that does not within the deadline is named."""
        try:
            check_in(store, f"{prefix}/joined", rank, list(ranks), Deadline(timeout_s), what)
        except RendezvousTimeoutError as exc:
            raise CommGroupError(f"{exc} (seen from rank {rank})", tuple(exc.missing)) from exc

    def _member_group(
        self,
        store: Any,
        prefix: str,
        ranks: Sequence[int],
        rank: int,
        timeout_s: float,
        backend: str,
        what: str,
    ) -> MemberGroup:
        """A `MemberGroup` of `ranks` (world ranks); its one check-in names missing world ranks."""
        try:
            return MemberGroup.create(store, prefix, ranks.index(rank), len(ranks), timeout_s, backend)
        except RendezvousTimeoutError as exc:
            missing = tuple(ranks[m] for m in exc.missing)
            raise CommGroupError(
                f"{what}: rank(s) {list(missing)} did not join within {timeout_s:.1f}s "
                f"(seen from rank {rank})",
                missing,
            ) from exc

    def init_distributed_env(
        self,
        rank: int,
        world_size: int,
        local_rank: int,
        local_world_size: int,
        master_addr: str,
        master_port: int,
        backend: str = "gloo",
        timeout_s: float | None = None,
        epoch: str = "0",
    ) -> int:
        """Join the world process group; bounded, naming the ranks that did not join."""
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        self._destroy_groups()
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0 and self._store is not None and self._store_port == master_port:
            store = self._store
        else:
            store = _c10d.TCPStore(master_addr, master_port, None, False, timeout=timeout)
            self._store = store
        prefix = f"rlfleet/{epoch}"
        self._join(store, f"{prefix}/world", rank, range(world_size), timeout_s, "init_distributed_env")
        dist.init_process_group(
            backend,
            store=_c10d.PrefixStore(f"{prefix}/pg", store),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
        self._prefix = prefix
        self._rank = rank
        self._world_size = world_size
        self._local_rank = local_rank
        self._local_world_size = local_world_size
        return rank

    def init_single_comm_group(
        self,
        ranks: Sequence[int],
        mode: str | ParallelMode,
        backend: str = "gloo",
        group_id: str | None = None,
        timeout_s: float | None = None,
    ) -> bool:
        """Create one process group among `ranks` (members only; a rank may be in many groups)."""
        mode = mode.value if isinstance(mode, ParallelMode) else str(mode)
        group_id = group_id or f"{mode}/{'-'.join(map(str, ranks))}"
        ranks = [int(r) for r in ranks]
        if self._rank not in ranks:
            return False
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        if not dist.is_initialized():
            raise CommGroupError(f"group {group_id!r}: init_distributed_env() must come first")
        prefix, what = f"{self._prefix}/pg/{group_id}", f"group {group_id!r}"
        group = self._member_group(self._store, prefix, ranks, self._rank, timeout_s, backend, what)
        self._groups[group_id] = group
        self._group_ranks[group_id] = tuple(ranks)
        if mode != ParallelMode.WEIGHT_TRANSFER.value or mode not in self._groups_by_mode:
            self._groups_by_mode[mode] = group
            self._mode_ranks[mode] = tuple(ranks)
        return True

    def init_comm_groups(
        self, specs: Sequence[Mapping[str, Any]], backend: str, timeout_s: float, registered: bool = False
    ) -> int:
        """Create several groups in the given order (one RPC per actor instead of one per group).

        `registered`: every rank of the world calls this with every group, in the same order, and
        the groups are torch.distributed groups (rlfleet.weightsync's bounded `new_group`), usable
        by `dist.*` collectives and weightsync's broadcast protocol. Otherwise only members call
        it and each group is a standalone process group (what still works after a rank died).
        """
        if not registered:
            made = 0
            for spec in specs:
                made += bool(
                    self.init_single_comm_group(
                        spec["ranks"], spec["mode"], backend, group_id=spec["group_id"], timeout_s=timeout_s
                    )
                )
            return made
        made = 0
        for spec in specs:
            ranks = [int(r) for r in spec["ranks"]]
            group = new_group_bounded(
                ranks,
                backend=backend,
                timeout=timeout_s,
                join_timeout=timeout_s,
                key=f"{self._prefix}/{spec['group_id']}",
            )
            if self._rank not in ranks:
                continue
            group_id, mode = str(spec["group_id"]), str(spec["mode"])
            self._groups[group_id] = group
            self._group_ranks[group_id] = tuple(ranks)
            self._registered.add(group_id)
            if mode != ParallelMode.WEIGHT_TRANSFER.value or mode not in self._groups_by_mode:
                self._groups_by_mode[mode] = group
                self._mode_ranks[mode] = tuple(ranks)
            made += 1
        return made

    def _group(self, group_id: str) -> Any:
        try:
            return self._groups[group_id]
        except KeyError:
            raise CommGroupError(
                f"rank {self._rank}: no communication group {group_id!r} (have {sorted(self._groups)})"
            ) from None

    def get_rank(self) -> int:
        return self._rank

    def get_groups(self) -> dict[str, list[int]]:
        return {k: list(v) for k, v in self._group_ranks.items()}

    def dist_barrier(self, mode: str | ParallelMode | None = None, timeout_s: float | None = None) -> None:
        """Barrier over the world (mode None) or over this rank's group of `mode` (if it has one)."""
        if not dist.is_initialized():
            return
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        key = mode.value if isinstance(mode, ParallelMode) else mode
        if key is None:
            work = dist.barrier(async_op=True)
        else:
            group = self._groups_by_mode.get(key)
            if group is None:
                return
            member = isinstance(group, MemberGroup)
            work = group.process_group.barrier() if member else dist.barrier(group=group, async_op=True)
        if not work.wait(timeout=datetime.timedelta(seconds=timeout_s)):
            raise SyncTimeoutError(f"barrier on {key or 'world'} timed out after {timeout_s:.1f}s")

    def init_collective(
        self,
        ip: str,
        port: int,
        world_size: int,
        *,
        train_world_size: int,
        nccl_peer: str = "nemo",
        rank: int | None = None,
        timeout_s: float | None = None,
    ) -> None:
        """NeMo RL: join the trainers + inference model-update group at ip:port (gloo on CPU).

        Train workers take ranks [0, train_world_size); inference workers follow them.
        """
        if rank is None:
            rank = self.index if self.role == PolicyRole.TRAIN else train_world_size + self.index
        if not 0 <= rank < world_size:
            raise ValueError(f"init_collective: rank {rank} outside world_size {world_size}")
        timeout_s = self.config.group_timeout_s if timeout_s is None else timeout_s
        deadline = Deadline(timeout_s)
        try:  # rank 0 hosts the store, listening on `ip` only
            store = connect_store(ip, port, rank, world_size, deadline)
        except RendezvousTimeoutError as exc:
            raise CommGroupError(f"init_collective: {exc}", tuple(exc.missing)) from exc
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        left = max(deadline.remaining_or(timeout_s), 1.0)
        what = "init_collective"
        group = self._member_group(store, "collective", range(world_size), rank, left, backend, what)
        self.model_update_group = group.process_group
        self._collective_store = store

    # ================================================================== NeMo RL worker surface
    def is_alive(self) -> bool:
        return True

    def reset_peak_memory_stats(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._peak_reset_at = time.time()

    def get_gpu_info(self) -> dict[str, Any]:
        if self.device.type == "cuda":
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            props = torch.cuda.get_device_properties(idx)
            free, total = torch.cuda.mem_get_info(idx)
            return {
                "device": f"cuda:{idx}",
                "name": props.name,
                "uuid": self.report_device_id(),
                "total_memory": int(total),
                "free_memory": int(free),
                "memory_allocated": int(torch.cuda.memory_allocated(idx)),
                "max_memory_allocated": int(torch.cuda.max_memory_allocated(idx)),
                "compute_capability": f"{props.major}.{props.minor}",
                "node_id": self._get_node_id(),
                "pid": os.getpid(),
            }
        total, free = _host_memory()
        return {
            "device": "cpu",
            "name": platform.processor() or platform.machine(),
            "uuid": self.report_device_id(),
            "total_memory": total,
            "free_memory": free,
            "memory_allocated": sum(t.numel() * t.element_size() for t in state_of(self.model).values()),
            "num_threads": torch.get_num_threads(),
            "node_id": self._get_node_id(),
            "pid": os.getpid(),
        }

    def report_device_id(self) -> str:
        if self.device.type == "cuda":
            idx = self.device.index if self.device.index is not None else torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(idx).uuid)
            return uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        return f"CPU-{socket.gethostname()}-{self._get_node_id()[:12]}"

    def get_free_memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        return _host_memory()[1]

    def report_node_ip_and_gpu_id(self) -> tuple[str, int]:
        gpu = self._get_gpu_ids()[0] if self.device.type == "cuda" else -1
        return _node_ip(), gpu

    def _profiler_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        # the torch profiler must start and stop on one thread (a Ray actor's calls run on many)
        if self._profile_exec is None:
            self._profile_exec = concurrent.futures.ThreadPoolExecutor(1, "rlfleet-profiler")
        return self._profile_exec

    def start_gpu_profiling(self, trace_dir: str | None = None) -> None:
        """Start the torch profiler (CPU, plus CUDA when on a GPU)."""
        if self._profiler is not None:
            raise RuntimeError("profiling is already running")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile_dir = trace_dir or tempfile.mkdtemp(prefix="rlfleet-profile-")
        prof = torch.profiler.profile(activities=activities, record_shapes=False)
        self._profiler_thread().submit(prof.__enter__).result(timeout=60)
        self._profiler = prof

    def stop_gpu_profiling(self) -> str | None:
        """Stop the profiler; returns the path of the Chrome trace written (None if not running)."""
        prof, self._profiler = self._profiler, None
        if prof is None:
            return None
        assert self._profile_dir is not None
        path = os.path.join(self._profile_dir, f"{self.role.value}{self.index}-{os.getpid()}.json")

        def stop() -> None:
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(path)

        self._profiler_thread().submit(stop).result(timeout=120)
        return path

    def stand_down_refit_watchdog(self) -> int:
        return stand_down_armed_watchdogs()

    def get_reference_policy_logprobs(
        self, *, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Log-probs of `data`'s actions under the frozen reference copy of the policy.

        `data["actions"]` ([B] or [B, T]) with `obs`: log-prob of each action. `input_ids`
        alone ([B, T]): NeMo's convention, token i scored by the logits at i-1, position 0 is 0.
        """
        if self._ref_model is None:
            self._ref_model = copy.deepcopy(self.model).eval()
            for p in self._ref_model.parameters():
                p.requires_grad_(False)
        key = "obs" if "obs" in data else "input_ids"
        n = int(data[key].shape[0])
        mb = micro_batch_size or n or 1
        outs = []
        with torch.no_grad():
            for start in range(0, n, mb):
                part = {k: (v[start : start + mb] if torch.is_tensor(v) else v) for k, v in data.items()}
                logp = torch.log_softmax(self.policy_logits(self._ref_model, part).float(), dim=-1)
                if "actions" in part:
                    actions = part["actions"].to(logp.device).long()
                    outs.append(logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1))
                else:
                    ids = part["input_ids"].to(logp.device).long()
                    scored = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                    outs.append(torch.cat([torch.zeros_like(scored[:, :1]), scored], dim=1))
        return {"reference_logprobs": torch.cat(outs).cpu()}

    # ================================================================== checkpoints
    def save_checkpoint(self, path: str, async_save: bool = False) -> str:
        """Write model (+ optimizer) state to `path`; with `async_save` in a background thread."""
        self.finalize_async_save()
        state = {
            "model": self.get_state_dict(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "version": self._version,
        }

        def write() -> None:
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}"
            torch.save(state, tmp)
            os.replace(tmp, path)

        if not async_save:
            write()
            return path

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # surfaced by finalize_async_save
                self._save_error = exc

        self._save_thread = threading.Thread(target=run, name="rlfleet-async-save", daemon=True)
        self._save_thread.start()
        return path

    def load_checkpoint(self, path: str) -> int:
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        return int(state.get("version", 0))

    def finalize_async_save(self, timeout: float = 600.0) -> None:
        thread, self._save_thread = self._save_thread, None
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._save_thread = thread
                raise TimeoutError(f"async checkpoint still writing after {timeout:.1f}s")
        error, self._save_error = self._save_error, None
        if error is not None:
            raise RuntimeError(f"async checkpoint failed: {error}") from error

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self.finalize_async_save()
        self._finished = True

    def shutdown(self) -> bool:
        with contextlib.suppress(Exception):
            self.finalize_async_save()
        if self._profiler is not None:
            self.stop_gpu_profiling()
        self.release_weight_buffers()
        self._destroy_groups()
        self.model_update_group = None
        return True

    # ================================================================== offload
    def _move_optimizer(self, device: torch.device) -> None:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if torch.is_tensor(v) and v.device != device:
                    state[k] = v.to(device)

    def offload_model(self) -> None:
        """Eval: move the model to host memory (a no-op move on CPU)."""
        if self.device.type != "cpu" and self._shared_reader is None:
            self.model.to("cpu")
        self._offloaded["model"] = True

    def reload_model(self) -> None:
        if self.device.type != "cpu" and self._shared_reader is None:
            self.model.to(self.device)
        self._offloaded["model"] = False

    def offload_optimizer(self) -> None:
        self._move_optimizer(torch.device("cpu"))
        self._offloaded["optimizer"] = True

    def reload_optimizer(self) -> None:
        self._move_optimizer(self.device)
        self._offloaded["optimizer"] = False

    def offload_model_param_and_grad(self, offload_grad: bool = True) -> None:
        if self.device.type != "cpu":
            for p in self.model.parameters():
                p.data = p.data.to("cpu", non_blocking=True)
                if offload_grad and p.grad is not None:
                    p.grad = p.grad.to("cpu", non_blocking=True)
        self._offloaded["model"] = True
        self._offloaded["grad"] = offload_grad

    def reload_model_param_and_grad(self, load_grad: bool = True) -> None:
        if self.device.type != "cpu":
            for p in self.model.parameters():
                p.data = p.data.to(self.device, non_blocking=True)
                if load_grad and p.grad is not None:
                    p.grad = p.grad.to(self.device, non_blocking=True)
        self._offloaded["model"] = False
        self._offloaded["grad"] = False

    def get_offload_state(self) -> dict[str, bool]:
        return dict(self._offloaded)
