"""vLLM recipe: a worker extension that receives each version through rlfleet and loads it with
the model's own ``load_weights``. Not run in CI (no vLLM, no GPU here); type-checked against
`engines.py`.

Rollout side: start vLLM with this class mixed into its workers,

    llm = vllm.LLM(model=..., worker_extension_cls="vllm_worker_extension.RlfleetWorkerExtension")

Trainer side (rank 0 of the trainer, or each FSDP rank through `weightsync.full_tensors`):

    store = host_store(trainer_ip, 0)                        # a TCPStore for the rendezvous
    session = VllmSync.connect(llm, store, trainer_ip, layout, workers=tp * dp)  # JoinOptions: see below
    session.push(model.state_dict(), version=step)          # every worker holds `step`, or it raises

Every vLLM worker receives the whole model over an rlfleet broadcast (bucketed, pipelined,
two-phase commit, deadlines) and hands it to ``model.load_weights``, which stacks q/k/v and
gate/up and takes its tensor-parallel shard itself. The receiver stages each version and feeds
the engine only once every bucket arrived on every worker ("staged"): a failed transfer leaves
the engine on the previous version. ``process_weights_after_loading`` runs once per version
(``finalize=True``; needed for quantized checkpoints, a no-op for plain bf16 ones).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from engines import VllmLLM, VllmModelRunner

from rlfleet.weightsync import (
    BroadcastReceiver,
    BroadcastSender,
    Deadline,
    Layout,
    LoadWeightsConsumer,
    MemberGroup,
    Rename,
    WeightTransform,
    connect_store,
)

GROUP_PREFIX = "rlfleet/vllm"


@dataclass(frozen=True)
class JoinOptions:
    """How the workers receive. `rename_prefix` maps the trainer's names onto the checkpoint
    names vLLM's ``load_weights`` reads (e.g. ``("module.", "")``); `finalize` runs vLLM's
    ``process_weights_after_loading`` after each version."""

    timeout_s: float = 300.0
    backend: str = "nccl"
    rename_prefix: tuple[str, str] | None = None
    finalize: bool = True


class RlfleetWorkerExtension:
    """Mixed into every vLLM worker; its methods are called through ``LLM.collective_rpc``."""

    # provided by the vLLM worker this class is mixed into
    model_runner: VllmModelRunner
    device: torch.device
    rank: int

    def rlfleet_join(
        self, store_host: str, store_port: int, layout_json: str, group_size: int, options: JoinOptions
    ) -> str:
        """Join the trainer's broadcast group as member ``1 + rank``; returns the layout digest."""
        member = 1 + self.rank
        timeout_s = options.timeout_s
        store = connect_store(store_host, store_port, member, group_size, Deadline(timeout_s))
        group = MemberGroup.create(store, GROUP_PREFIX, member, group_size, timeout_s, options.backend)
        layout = Layout.from_json(layout_json)
        prefix = options.rename_prefix
        transforms: list[WeightTransform] = [] if prefix is None else [Rename.prefix(*prefix)]
        self._rlfleet_consumer = LoadWeightsConsumer(
            layout,
            self.model_runner.model.load_weights,
            finalize=self._rlfleet_finalize if options.finalize else None,
            transforms=transforms,
            mode="staged",
            device=self.device,
        )
        self._rlfleet_receiver = BroadcastReceiver(layout, group, 0, device=self.device)
        return layout.digest

    def rlfleet_receive(self, timeout_s: float = 300.0) -> int:
        """Receive one version and load it; returns the version now served."""
        self._rlfleet_receiver.receive(self._rlfleet_consumer, Deadline(timeout_s))
        return self._rlfleet_consumer.version

    def _rlfleet_finalize(self) -> None:
        from vllm.model_executor.model_loader.utils import (  # type: ignore[import-not-found]
            process_weights_after_loading,
        )

        runner = self.model_runner
        process_weights_after_loading(runner.model, runner.model_config, self.device)


class VllmSync:
    """The trainer's end: one rlfleet broadcast group with every vLLM worker."""

    def __init__(self, llm: VllmLLM, sender: BroadcastSender, workers: int, timeout_s: float) -> None:
        self.llm = llm
        self.sender = sender
        self.workers = workers
        self.timeout_s = timeout_s

    @classmethod
    def connect(
        cls,
        llm: VllmLLM,
        store: Any,
        store_host: str,
        layout: Layout,
        workers: int,
        options: JoinOptions | None = None,
    ) -> VllmSync:
        """Form the group (the trainer is member 0) while every worker joins it."""
        options = options if options is not None else JoinOptions()
        size = 1 + workers
        args = (store_host, int(store.port), layout.to_json().decode(), size, options)
        with ThreadPoolExecutor(1) as pool:
            joining = pool.submit(llm.collective_rpc, "rlfleet_join", timeout=options.timeout_s, args=args)
            group = MemberGroup.create(store, GROUP_PREFIX, 0, size, options.timeout_s, options.backend)
            digests = joining.result(timeout=options.timeout_s)
        if set(digests) != {layout.digest}:
            raise RuntimeError(f"vLLM workers built other layouts: {sorted(set(digests))}")
        device = "cuda" if options.backend == "nccl" else "cpu"
        sender = BroadcastSender(layout, group, 0, device=device)
        return cls(llm, sender, workers, options.timeout_s)

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Send `version`; returns once every worker loaded it (raises, all on the old one, if not)."""
        deadline = Deadline(self.timeout_s)
        with ThreadPoolExecutor(1) as pool:
            loading = pool.submit(
                self.llm.collective_rpc, "rlfleet_receive", timeout=self.timeout_s, args=(self.timeout_s,)
            )
            self.sender.send(state, version, deadline)
            served = loading.result(timeout=deadline.remaining())
        if set(served) != {version}:
            raise RuntimeError(f"vLLM workers serve versions {served}, expected {version}")
