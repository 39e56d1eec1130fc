"""vLLM recipe: a worker extension that receives each version through an rlfleet broadcast and
applies it with vLLM's reload path. Run against the real vLLM 0.33 (its Worker on the CPU, the
arguments msgpack-encoded as its multiprocess engine does) by ``tests/e2e/test_vllm.py -m vllm``;
type-checked against `engines.py`. With vLLM 0.33 and later, prefer the "rlfleet" weight-transfer
backend (``rlfleet.weightsync.engines``, README): the same guarantees behind vLLM's own API.

Rollout side: start vLLM with this class mixed into its workers,

    llm = vllm.LLM(model=..., worker_extension_cls="vllm_worker_extension.RlfleetWorkerExtension")

Trainer side (rank 0 of the trainer, or each FSDP rank through `weightsync.full_tensors`):

    store = host_store(trainer_ip, 0)                        # a TCPStore for the rendezvous
    session = VllmSync.connect(llm, store, trainer_ip, layout, workers=tp * dp)  # JoinOptions: see below
    session.push(model.state_dict(), version=step)          # every worker holds `step`, or it raises

Every vLLM worker receives the whole model over an rlfleet broadcast (bucketed, pipelined,
two-phase commit, deadlines) and stages it; only once every bucket reached every worker does it
apply the version, with vLLM's layerwise reload (``load_weights`` stacks q/k/v and gate/up and
takes the rank's shard; each layer's post-load processing runs once it is complete), so a failed
transfer leaves the engine on the previous version. At join, a dry run of the model's own
``load_weights`` on the trainer's layout (`record_loader_map`) checks that the layout loads every
parameter (an error names the first one it does not) and gives the transforms: the tensors the
loader ignores (a tied ``lm_head.weight``) are dropped, each tensor is cast to the dtype it lands in.

Only plain JSON-able values cross ``collective_rpc`` (vLLM's multiprocess engine msgpack-encodes
the arguments: a dataclass arrives as a dict, a tuple as a list): `JoinOptions` travels as its
`to_dict()`. A worker that fails answers the RPC at once; the trainer's half of each rendezvous
runs beside the RPC (`run_together`), so that error is raised at once, not after a timeout.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
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
    plan_transforms,
    record_loader_map,
)
from rlfleet.weightsync.engines import UnmappableLoaderError, reload_vllm_weights, run_together

GROUP_PREFIX = "rlfleet/vllm"


@dataclass(frozen=True)
class JoinOptions:
    """How the workers receive. `rename_prefix` maps the trainer's names onto the checkpoint
    names vLLM's ``load_weights`` reads (e.g. ``("module.", "")``); `reload` applies each
    version with vLLM's layerwise reload (False: the model's plain ``load_weights``, for a model
    that is not vLLM's)."""

    timeout_s: float = 300.0
    backend: str = "nccl"
    rename_prefix: tuple[str, str] | None = None
    reload: bool = True

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able values, what ``collective_rpc`` carries intact."""
        out = asdict(self)
        out["rename_prefix"] = None if self.rename_prefix is None else list(self.rename_prefix)
        return out

    @classmethod
    def from_value(cls, value: JoinOptions | dict[str, Any]) -> JoinOptions:
        """From the dict a worker receives (or the options themselves); a bad field is named."""
        if isinstance(value, JoinOptions):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"JoinOptions: expected a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"JoinOptions: unknown field(s) {unknown} (known: {sorted(known)})")
        prefix = value.get("rename_prefix")
        if prefix is not None and not (
            isinstance(prefix, (list, tuple)) and len(prefix) == 2 and all(isinstance(p, str) for p in prefix)
        ):
            raise ValueError(f"JoinOptions: rename_prefix must be [old, new] (two strings), got {prefix!r}")
        timeout_s = value.get("timeout_s", cls.timeout_s)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"JoinOptions: timeout_s must be a number > 0, got {timeout_s!r}")
        return cls(
            timeout_s=float(timeout_s),
            backend=str(value.get("backend", cls.backend)),
            rename_prefix=None if prefix is None else (prefix[0], prefix[1]),
            reload=bool(value.get("reload", cls.reload)),
        )


class RlfleetWorkerExtension:
    """Mixed into every vLLM worker; its methods are called through ``LLM.collective_rpc``."""

    # provided by the vLLM worker this class is mixed into
    model_runner: VllmModelRunner
    device: torch.device
    rank: int

    def rlfleet_join(
        self, store_host: str, store_port: int, layout_json: str, group_size: int, options: dict[str, Any]
    ) -> str:
        """Check the layout against the model's loader, then join the trainer's broadcast group as
        member ``1 + rank``; returns the layout digest."""
        opts = JoinOptions.from_value(options)
        layout = Layout.from_json(layout_json)
        rename: list[WeightTransform] = (
            [] if opts.rename_prefix is None else [Rename.prefix(*opts.rename_prefix)]
        )
        model = self.model_runner.get_model()  # on a GPU, runner.model may be a CUDA-graph wrapper
        entries = plan_transforms(rename, ((s.name, s.shape, s.dtype) for s in layout.tensors))
        derived: list[WeightTransform] = []
        try:
            loader_map = record_loader_map(model.load_weights, model, entries)
            loader_map.require_covered()  # names the first parameter the trainer's layout cannot load
            derived = loader_map.transforms()
        except UnmappableLoaderError:
            pass  # a loader that computes what it writes (quantizing as it loads): no derived transforms
        self._rlfleet_consumer = LoadWeightsConsumer(
            layout,
            self._rlfleet_load if opts.reload else model.load_weights,
            transforms=rename + derived,
            mode="staged",
        )
        member = 1 + self.rank
        store = connect_store(store_host, store_port, member, group_size, Deadline(opts.timeout_s))
        group = MemberGroup.create(store, GROUP_PREFIX, member, group_size, opts.timeout_s, opts.backend)
        device = self.device if opts.backend == "nccl" else torch.device("cpu")
        self._rlfleet_receiver = BroadcastReceiver(layout, group, 0, device=device)
        return layout.digest

    def rlfleet_receive(self, timeout_s: float = 300.0) -> int:
        """Receive one version and apply it; returns the version now served."""
        self._rlfleet_receiver.receive(self._rlfleet_consumer, Deadline(timeout_s))
        return self._rlfleet_consumer.version

    def _rlfleet_load(self, weights: Any) -> Any:
        """vLLM's reload path (finalized even when ``load_weights`` raises), then the resets
        vLLM's own ``reload_weights`` makes (LoRA, encoder and multimodal caches)."""
        runner = self.model_runner
        result = reload_vllm_weights(runner.get_model(), runner.model_config, weights, self.device)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            hook = getattr(runner, reset, None)
            if callable(hook):
                hook()
        return result


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
        """Form the group (the trainer is member 0) while every worker joins it; a worker's error
        is raised as soon as its RPC answers."""
        options = options if options is not None else JoinOptions()
        size = 1 + workers
        args = (store_host, int(store.port), layout.to_json().decode(), size, options.to_dict())
        digests, group = run_together(
            [
                lambda: llm.collective_rpc("rlfleet_join", timeout=options.timeout_s, args=args),
                lambda: MemberGroup.create(store, GROUP_PREFIX, 0, size, options.timeout_s, options.backend),
            ],
            options.timeout_s,
            "joining the vLLM workers",
        )
        if set(digests) != {layout.digest}:
            raise RuntimeError(f"vLLM workers built other layouts: {sorted(set(digests))}")
        device = "cuda" if options.backend == "nccl" else "cpu"
        sender = BroadcastSender(layout, group, 0, device=device)
        return cls(llm, sender, workers, options.timeout_s)

    def push(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Send `version`; returns once every worker applied it (raises, all on the old one, if not)."""
        deadline = Deadline(self.timeout_s)
        served, _ = run_together(
            [
                lambda: self.llm.collective_rpc(
                    "rlfleet_receive", timeout=self.timeout_s, args=(self.timeout_s,)
                ),
                lambda: self.sender.send(state, version, deadline),
            ],
            self.timeout_s,
            f"sending version {version}",
        )
        if set(served) != {version}:
            raise RuntimeError(f"vLLM workers serve versions {served}, expected {version}")
