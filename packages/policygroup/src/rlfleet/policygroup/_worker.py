"""`BasePolicy`: the worker side of a policy group (the seed's worker calls and NeMo RL's surface).

A user subclasses it and supplies the model (`build_model`), the rollout step (`rollout_step`)
and the training step (`train_step`). The rest is delegated to small components, most of them
weightsync's: communication groups (`CommGroupCalls`), the calls of a weight sync and the
endpoint versions arrive through (`WeightCalls`), NeMo RL's refit and reshard calls
(`RefitCalls`, `ReshardCalls`), device facts and profiling, checkpoints and offload. This
package adds the reshard planning (`_reshard`, with rlfleet.placement) and where the worker
runs on Ray (`_device`).
It works the same as a local object and as a Ray actor.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rlfleet.policygroup import _device
from rlfleet.policygroup._config import PolicyConfig, TrainConfig
from rlfleet.policygroup._errors import WorkerDiedError
from rlfleet.policygroup._reshard import ReshardWorkerMixin
from rlfleet.weightsync import (
    Checkpoints,
    CommGroupCalls,
    Layout,
    Offload,
    Profiler,
    RefitCalls,
    ServingLock,
    Timings,
    WeightCalls,
    WorkerComm,
    WorkerWeights,
    checksum,
    device_id,
    device_info,
    fingerprint,
    free_memory,
    reset_peak_memory,
)


class PolicyRole(str, enum.Enum):
    """The two sides: a trainer ("train") and a rollout worker ("eval", the seed's name)."""

    TRAIN = "train"
    EVAL = "eval"


ROLE_NAMES = {PolicyRole.TRAIN: "trainer", PolicyRole.EVAL: "rollout worker"}  # in messages


class BasePolicy(CommGroupCalls, WeightCalls, ReshardWorkerMixin, RefitCalls):
    """A trainer or rollout worker; subclass it with a model, a rollout step and a train step.

    Works as a plain object (single process) and as a Ray actor (`ray.remote(cls)`); the policy
    group drives it either way. A rollout worker receives weights through one weightsync
    endpoint ("None", "Double", "Shared" or "Sharded"); a request never sees half a version.
    """

    config: PolicyConfig  # the mixins need only weightsync's `WorkerSettings` of it

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
        self.role: PolicyRole = PolicyRole(role)
        self.index = index
        self.seed = seed
        torch.manual_seed(seed)
        if device is None:
            gpus = self.config.train_num_gpus if self.role == PolicyRole.TRAIN else self.config.eval_num_gpus
            device = "cuda" if torch.cuda.is_available() and gpus > 0 else "cpu"
        self.device = torch.device(device)
        self.model: torch.nn.Module = self.build_model().to(self.device)
        self.optimizer: torch.optim.Optimizer | None = None
        self.train_config: TrainConfig | None = None
        self.env_meta: Any = None
        self.eval_config: Any = None
        self.dataset: Any = None
        self.model_update_group: Any = None
        self.pp_comm_group: Any = None
        self._serve = ServingLock()  # rollouts share it; a weight swap takes it exclusively
        self._count_lock = threading.Lock()
        self._num_requests = 0
        self._timings = Timings()
        self._ref_model: torch.nn.Module | None = None
        self._comm = WorkerComm(self.config.group_timeout_s)
        c = self.config
        timeouts = {"commit_timeout_s": c.drain_timeout_s, "attach_timeout_s": c.group_timeout_s}
        self._weights = WorkerWeights(
            self._serve,
            self._who,
            bucket_bytes=c.weight_buffer.bucket_bytes,
            write_timeout_s=c.sync_timeout_s,
            **timeouts,
        )
        self._checkpoints = Checkpoints()
        self._offload = Offload(self.device)
        self._profiler = Profiler()
        # Ray restarted this actor after a crash (max_restarts): calls queued for the dead process
        # arrive here, where the group's weights are gone, until the group connects us again
        self._restarted = _device.was_restarted()

    def _who(self) -> str:
        return f"{ROLE_NAMES[self.role]} {self.index}"

    # ================================================================== user hooks
    def build_model(self) -> torch.nn.Module:
        """Return the policy's model (called once, in the worker)."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_model()")

    def rollout_step(self, env_ret: Any) -> Any:
        """One policy response for one environment return (rollout workers)."""
        raise NotImplementedError(f"{type(self).__name__} must implement rollout_step(env_ret)")

    def rollout_many_step(self, env_rets: list[Any]) -> list[Any]:
        """Responses for a list of env returns; override to batch them into one forward pass."""
        return [self.rollout_step(x) for x in env_rets]

    def train_step(self, batch: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        """One optimisation step on `batch` (trainers); returns scalar metrics."""
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

    # ================================================================== seed lifecycle
    def init_eval(self, eval_config: Any = None, env_meta: Any = None) -> None:
        self.set_role(PolicyRole.EVAL)
        self.eval_config, self.env_meta = eval_config, env_meta
        self.model.eval()

    def init_train(self, train_config: TrainConfig | None = None, env_meta: Any = None) -> None:
        self.set_role(PolicyRole.TRAIN)
        self.train_config, self.env_meta = train_config, env_meta
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
        return self._timings.summary(f"{self.role.value}{self.index}", reset)

    def set_role(self, role: PolicyRole | str, index: int | None = None) -> None:
        """Become a trainer or a rollout worker (role conversion); weights are kept."""
        role = PolicyRole(role)
        if index is not None:
            self.index = index
        if role == self.role:
            return
        if role == PolicyRole.TRAIN:
            self.release_weight_buffers()  # the trainer needs private, writable storage
            self.model.train()
        else:
            self.optimizer = None
            self.model.eval()
        self.role = role

    def get_role(self) -> str:
        return self.role.value

    # ================================================================== serving
    def _refuse_if_restarted(self) -> None:
        if self._restarted and self.role == PolicyRole.EVAL:
            raise WorkerDiedError(
                f"rollout worker {self.index} was restarted after a crash and holds its initial weights "
                "until its group connects it again (init_weight_buffer); retry on another worker",
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
            self._timings.add("rollout", start)

    def _rollout_many(self, env_rets: Sequence[Any]) -> Any:
        """Several requests in one call (one Ray task, one return object per request)."""
        start = time.perf_counter()
        try:
            with self._serving(), torch.no_grad():
                out = self.rollout_many_step(list(env_rets))
        finally:
            self._timings.add("rollout_many", start)
        return out[0] if len(out) == 1 else tuple(out)

    def _postprocess(self, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.postprocess_step(*args)
        finally:
            self._timings.add("postprocess", start)

    def get_num_requests(self) -> int:
        return self._num_requests

    # ================================================================== training
    def update_dataset(self, data: Any) -> int:
        self.dataset = data
        return len(data) if hasattr(data, "__len__") else 1

    def train(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if self.role != PolicyRole.TRAIN:
            raise RuntimeError(f"train() called on {self._who()}")
        if self.optimizer is None:
            self.optimizer = self.build_optimizer(self.train_config)
        start = time.perf_counter()
        batch = args[0] if args else self.dataset
        try:
            return self.train_step(batch, *args[1:], **kwargs)
        finally:
            self._timings.add("train", start)

    # ================================================================== weights: inspection
    def get_param_fingerprint(self) -> dict[str, float]:
        return fingerprint(self.model.state_dict())

    def get_weight_checksum(self) -> str:
        return checksum(self.model.state_dict())

    def get_weight_version(self) -> int:
        return self._weights.version

    def set_weight_version(self, version: int) -> None:
        self._weights.version = int(version)

    def get_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                tensor.copy_(state[name])

    def get_training_state(self) -> dict[str, Any]:
        """Model and optimizer state (to start a new data-parallel trainer exactly in step)."""
        optimizer = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        return {"model": self.get_state_dict(), "optimizer": optimizer, "train_config": self.train_config}

    def load_training_state(self, state: Mapping[str, Any]) -> None:
        """Become a replica of the trainer `state` came from (role must be train already)."""
        self.load_state_dict(state["model"])
        self.train_config = state.get("train_config", self.train_config)
        self.optimizer = self.build_optimizer(self.train_config)
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        self._ref_model = None

    def get_weight_layout(self, bucket_bytes: int) -> dict[str, Any]:
        return Layout.from_state_dict(self.model.state_dict(), bucket_bytes).to_dict()

    # ================================================================== NeMo RL worker surface
    def is_alive(self) -> bool:
        return True

    def _node_ip(self) -> str:
        return _device.node_ip()

    def _get_node_id(self) -> str:
        return _device.node_id()

    def _get_gpu_ids(self) -> list[int]:
        return _device.gpu_ids()

    def reset_peak_memory_stats(self) -> None:
        reset_peak_memory(self.device)

    def get_gpu_info(self) -> dict[str, Any]:
        model_bytes = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        return device_info(self.device, model_bytes, _device.node_id())

    def report_device_id(self) -> str:
        return device_id(self.device, _device.node_id())

    def get_free_memory_bytes(self) -> int:
        return free_memory(self.device)

    def report_node_ip_and_gpu_id(self) -> tuple[str, int]:
        return _device.node_ip(), self._get_gpu_ids()[0] if self.device.type == "cuda" else -1

    def start_gpu_profiling(self, trace_dir: str | None = None) -> None:
        """Start the torch profiler (CPU, plus CUDA when on a GPU)."""
        self._profiler.start(self.device, trace_dir)

    def stop_gpu_profiling(self) -> str | None:
        """Stop the profiler; returns the path of the Chrome trace written (None if not running)."""
        return self._profiler.stop(f"{self.role.value}{self.index}")

    def get_reference_policy_logprobs(
        self, *, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Log-probs of `data`'s actions under the frozen reference copy of the policy.

        `data["actions"]` ([B] or [B, T]) with `obs`: log-prob of each action. `input_ids`
        alone ([B, T]): NeMo's convention, token i scored by the logits at i-1, position 0 is 0.
        """
        if self._ref_model is None:
            self._ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        n = int(data["obs" if "obs" in data else "input_ids"].shape[0])
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
        optimizer = copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        state = {"model": self.get_state_dict(), "optimizer": optimizer, "version": self._weights.version}
        return self._checkpoints.save(state, path, async_save)

    def load_checkpoint(self, path: str) -> int:
        state = self._checkpoints.load(path)
        self.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        return int(state.get("version", 0))

    def finalize_async_save(self, timeout: float = 600.0) -> None:
        self._checkpoints.finalize(timeout)

    def finish_training(self, *args: Any, **kwargs: Any) -> None:
        self.finalize_async_save()

    def shutdown(self) -> bool:
        with contextlib.suppress(Exception):
            self.finalize_async_save()
        self._profiler.stop(f"{self.role.value}{self.index}")
        self.release_weight_buffers()
        self._comm.destroy()
        self.model_update_group = None
        return True

    # ================================================================== offload
    def offload_model(self) -> None:
        """Rollout worker: move the model to host memory (a no-op move on CPU)."""
        self._offload.model(self.model, True, self._bound_to_node_buffer())

    def reload_model(self) -> None:
        self._offload.model(self.model, False, self._bound_to_node_buffer())

    def _bound_to_node_buffer(self) -> bool:
        endpoint = self._weights.endpoint
        return endpoint is not None and endpoint.strategy == "Shared"

    def offload_optimizer(self) -> None:
        self._offload.optimizer(self.optimizer, True)

    def reload_optimizer(self) -> None:
        self._offload.optimizer(self.optimizer, False)

    def offload_model_param_and_grad(self, offload_grad: bool = True) -> None:
        self._offload.params_and_grads(self.model, True, offload_grad)

    def reload_model_param_and_grad(self, load_grad: bool = True) -> None:
        self._offload.params_and_grads(self.model, False, load_grad)

    def get_offload_state(self) -> dict[str, bool]:
        return self._offload.state()
