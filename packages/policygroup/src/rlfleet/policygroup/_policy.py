"""`BasePolicy`: the worker side of a policy group (the seed's worker calls and NeMo RL's surface).

A user subclasses it and supplies the model (`build_model`), the rollout step (`rollout_step`)
and the training step (`train_step`). The rest are Ray-free mixins over `WorkerHost` (which says
what they read): `worker/` (communication groups, the weight sync's calls, weights and training
state, checkpoints, reference log-probs with the `policy_logits` hook, device facts, profiling,
offload) and `nemo/` (NeMo RL's refit and reshard calls); `WorkerCalls` is all of them, for a
worker class of a user's own. `_ray_node` says where the worker runs on Ray. It works the same
as a local object and as a Ray actor.
"""

from __future__ import annotations

import contextlib
import enum
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import rlfleet.policygroup._ray_node as ray_node
from rlfleet.policygroup._config import PolicyConfig, TrainConfig
from rlfleet.policygroup._errors import WorkerDiedError
from rlfleet.policygroup.nemo import RefitCalls, ReshardCalls
from rlfleet.policygroup.worker import (
    CommGroupCalls,
    DeviceCalls,
    OffloadCalls,
    ReferenceCalls,
    StateCalls,
    WeightCalls,
)


class PolicyRole(str, enum.Enum):
    """The two sides: a trainer ("train") and a rollout worker ("eval", the seed's name)."""

    TRAIN = "train"
    EVAL = "eval"


ROLE_NAMES = {PolicyRole.TRAIN: "trainer", PolicyRole.EVAL: "rollout worker"}  # in messages
#: The keyword `PolicyGroup.train` adds once it asked a trainer for snapshots (non-blocking syncs):
#: the group's token and how many; `train` takes it off and the optimizer's fence waits until
#: that many of the group's were taken (a trainer actor may serve one group after another).
SNAPSHOTS_ASKED = "_rlfleet_snapshots"


class WorkerCalls(
    CommGroupCalls,
    WeightCalls,
    ReshardCalls,
    RefitCalls,
    StateCalls,
    ReferenceCalls,
    DeviceCalls,
    OffloadCalls,
):
    """Groups, the sync's calls, NeMo RL's refit and reshard calls, state, checkpoints, reference
    log-probs, device facts, profiling and offload of one worker.

    A host class inherits it, sets what `WorkerHost` declares and calls `_init_parts`; it adds its
    own hooks (`build_optimizer`, `_refuse_if_restarted`). `BasePolicy` is one such host.
    """


class BasePolicy(WorkerCalls):
    """A trainer or rollout worker; subclass it with a model, a rollout step and a train step.

    Works as a plain object (single process) and as a Ray actor (`ray.remote(cls)`); the policy
    group drives it either way. A rollout worker receives weights through one weightsync
    endpoint ("None", "Double", "Shared" or "Sharded"); a request never sees half a version.
    """

    config: PolicyConfig  # the mixins need only its `WorkerSettings` part
    train_config: TrainConfig | None

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
        self.index, self.seed = index, seed
        torch.manual_seed(seed)
        if device is None:
            gpus = self.config.train_num_gpus if self.role == PolicyRole.TRAIN else self.config.eval_num_gpus
            device = "cuda" if torch.cuda.is_available() and gpus > 0 else "cpu"
        self.device = torch.device(device)
        self.model: torch.nn.Module = self.build_model().to(self.device)
        self.env_meta: Any = None
        self.eval_config: Any = None
        self.dataset: Any = None
        self._count_lock = threading.Lock()
        self._num_requests = 0
        self._hook_lock = threading.Lock()
        self._hooked_version = 0  # the last version `on_weight_version` ran for
        # Ray restarted this actor after a crash (max_restarts): calls queued for the dead process
        # arrive here, where the group's weights are gone, until the group connects us again
        self._init_parts(restarted=ray_node.was_restarted())

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
        """One optimisation step on `batch` (trainers); returns scalar metrics.

        ``group.train(*args, **kwargs)`` calls it on every trainer with the same arguments:
        ``train_step(args[0], *args[1:], **kwargs)``, or, called without positional arguments,
        ``train_step(dataset, **kwargs)`` where `dataset` is this trainer's shard from
        ``group.update_dataset(shards)`` (one per trainer, in ``train_list`` order). The group
        returns the first trainer's metrics. A step that changes the weights without the
        optimizer (``self.optimizer``, fenced for you) calls `wait_for_weight_snapshot` first.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement train_step(batch)")

    def on_weight_version(self, version: int) -> None:
        """Called on a rollout worker once `version` is live, before any request computes with
        it: clear what the old weights left behind (an engine's KV / prefix cache). Default:
        nothing. It runs outside the swap; a request never sees the new version before it."""

    def postprocess_step(self, *args: Any) -> Any:
        """Post-process (env return, policy response); the default returns the last argument."""
        return args[-1] if args else None

    def build_optimizer(self, train_config: TrainConfig | None) -> torch.optim.Optimizer:
        lr = train_config.lr if train_config is not None else 1e-3
        return torch.optim.Adam(self.model.parameters(), lr=lr)

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
                self._version_live()
                yield
        finally:
            with self._count_lock:
                self._num_requests -= 1

    def _rollout(self, env_ret: Any) -> Any:
        with self._timings.measure("rollout"), self._serving(), torch.no_grad():
            return self.rollout_step(env_ret)

    def _version_live(self) -> None:
        """Run `on_weight_version` once per new version: right after its apply, and at the latest
        before the first request that computes with it."""
        version = self._weights.version
        if version == self._hooked_version:
            return
        with self._hook_lock:
            if version != self._hooked_version and self.role == PolicyRole.EVAL:
                self.on_weight_version(version)
            self._hooked_version = version

    def _rollout_versioned(self, env_rets: Sequence[Any]) -> tuple[Any, ...]:
        """Several requests in one call, then the weight version that served all of them (the
        serving lock is held throughout: no swap in between)."""
        with self._timings.measure("rollout_many"), self._serving(), torch.no_grad():
            version = self._weights.version
            out = list(self.rollout_many_step(list(env_rets)))
        if len(out) != len(env_rets):
            raise ValueError(
                f"{type(self).__name__}.rollout_many_step returned {len(out)} responses for "
                f"{len(env_rets)} requests"
            )
        return (*out, version)

    def _rollout_many(self, env_rets: Sequence[Any]) -> Any:
        """Several requests in one call (one Ray task, one return object per request)."""
        with self._timings.measure("rollout_many"), self._serving(), torch.no_grad():
            out = self.rollout_many_step(list(env_rets))
        return out[0] if len(out) == 1 else tuple(out)

    def _postprocess(self, *args: Any) -> Any:
        with self._timings.measure("postprocess"):
            return self.postprocess_step(*args)

    def get_num_requests(self) -> int:
        return self._num_requests

    # ================================================================== training
    def update_dataset(self, data: Any) -> int:
        self.dataset = data
        return len(data) if hasattr(data, "__len__") else 1

    def train(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        asked = kwargs.pop(SNAPSHOTS_ASKED, None)
        if asked is not None:  # (group token, how many snapshots its non-blocking syncs asked)
            asker, count = asked
            self._snapshots.expect(int(count), str(asker))
        if self.role != PolicyRole.TRAIN:
            raise RuntimeError(f"train() called on {self._who()}")
        if self.optimizer is None:
            self.optimizer = self.build_optimizer(self.train_config)
        self._fence_optimizer(self.optimizer)
        batch = args[0] if args else self.dataset
        with self._timings.measure("train"):
            return self.train_step(batch, *args[1:], **kwargs)

    def _fence_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Before every step of `optimizer`: the fence of non-blocking syncs (their snapshots are
        taken while the forward and backward run; only the update waits for them)."""
        if getattr(optimizer, "_rlfleet_fenced", False):
            return

        def fence(*_: Any) -> None:
            self.wait_for_weight_snapshot()

        optimizer.register_step_pre_hook(fence)
        optimizer._rlfleet_fenced = True  # type: ignore[attr-defined]

    # ================================================================== where we run (Ray)
    def _node_ip(self) -> str:
        return ray_node.node_ip()

    def _get_node_id(self) -> str:
        return ray_node.node_id()

    def _get_gpu_ids(self) -> list[int]:
        return ray_node.gpu_ids()
