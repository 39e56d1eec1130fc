"""rlfleet as a vLLM weight-transfer backend: its name, its JSON-safe infos and its registration.

vLLM (0.33) standardizes the receiving side as a `WeightTransferEngine` picked by name
(``weight_transfer_config={"backend": "rlfleet"}``) from a factory where backends register at
runtime. This module holds what needs no vLLM: the infos both sides exchange, and
`register_vllm_backend`, which registers the engine and trainer classes (`_vllm`,
`_vllm_trainer`, imported by vLLM only when it builds one) and is the ``vllm.general_plugins``
entry point, so every vLLM worker process registers it. Importing ``rlfleet.weightsync`` never
imports vLLM.

Only plain JSON-able values cross ``collective_rpc`` (vLLM's multiprocess engine msgpack-encodes
the arguments: a dataclass arrives as a dict, a tuple as a list), so the infos hold str, int,
float, bool, lists and None, and each checks its fields, naming a bad one.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from rlfleet.weightsync._errors import SyncTimeoutError

__all__ = [
    "VLLM_BACKEND",
    "VllmInitInfo",
    "VllmTrainerInitInfo",
    "VllmUpdateInfo",
    "register_vllm_backend",
    "reload_vllm_weights",
    "run_together",
]

_log = logging.getLogger(__name__)

#: The name vLLM's factories know the backend by.
VLLM_BACKEND = "rlfleet"
TRANSPORTS = ("node", "broadcast")
WIRES = ("gloo", "nccl")


def _require(ok: bool, owner: str, name: str, value: Any, want: str) -> None:
    if not ok:
        raise ValueError(f"{owner}: {name} must be {want}, got {value!r:.200}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")


def _prefix(value: Any, owner: str) -> tuple[str, str] | None:
    """A rename prefix pair from a list or tuple (msgpack turns tuples into lists)."""
    if value is None:
        return None
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, str) for v in value)
    _require(ok, owner, "rename_prefix", value, "[old, new] (two strings) or None")
    return (value[0], value[1])


@dataclass
class VllmInitInfo:
    """What ``init_weight_transfer_engine`` gets: where the versions come from.

    `transport` "node": the node buffer (`SharedBuffer`) named `node_name`, written by the
    trainer on this node. "broadcast": a group of `group_size` members on the trainer's store at
    `store_host`:`store_port` (the trainer is member 0, vLLM rank r member `member_offset + r`),
    over `wire` ("gloo" or "nccl"), with the layout sent as `layout_json`. `layout_digest` is
    checked against the buffer's or the sent layout. `rename_prefix` ``[old, new]`` maps the
    trainer's names onto the checkpoint names ``load_weights`` reads. `timeout_s` bounds each
    blocking step.
    """

    layout_digest: str
    transport: str = "node"
    node_name: str = ""
    store_host: str = ""
    store_port: int = 0
    group_size: int = 0
    member_offset: int = 1
    layout_json: str = ""
    wire: str = "gloo"
    rename_prefix: list[str] | None = None
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        owner = "rlfleet init_info"
        _require(
            isinstance(self.layout_digest, str) and bool(self.layout_digest),
            owner,
            "layout_digest",
            self.layout_digest,
            "a non-empty string",
        )
        _require(self.transport in TRANSPORTS, owner, "transport", self.transport, f"one of {TRANSPORTS}")
        _require(_positive(self.timeout_s), owner, "timeout_s", self.timeout_s, "a finite number > 0")
        _prefix(self.rename_prefix, owner)
        if self.transport == "node":
            _require(
                isinstance(self.node_name, str) and bool(self.node_name),
                owner,
                "node_name",
                self.node_name,
                "the node buffer's name (transport 'node')",
            )
            return
        _require(
            isinstance(self.store_host, str) and bool(self.store_host),
            owner,
            "store_host",
            self.store_host,
            "the trainer's store address (transport 'broadcast')",
        )
        _require(
            _is_int(self.store_port) and 0 < self.store_port < 65536,
            owner,
            "store_port",
            self.store_port,
            "a port in (0, 65536)",
        )
        _require(
            _is_int(self.member_offset) and self.member_offset >= 1,
            owner,
            "member_offset",
            self.member_offset,
            "an int >= 1 (member 0 is the trainer)",
        )
        _require(
            _is_int(self.group_size) and self.group_size > self.member_offset,
            owner,
            "group_size",
            self.group_size,
            f"an int > member_offset ({self.member_offset})",
        )
        _require(
            isinstance(self.layout_json, str) and bool(self.layout_json),
            owner,
            "layout_json",
            "...",
            "the layout as JSON text (transport 'broadcast')",
        )
        _require(self.wire in WIRES, owner, "wire", self.wire, f"one of {WIRES}")

    @property
    def prefix(self) -> tuple[str, str] | None:
        return _prefix(self.rename_prefix, "rlfleet init_info")


@dataclass
class VllmUpdateInfo:
    """What ``update_weights`` gets: the version to take (and, optionally, its own deadline)."""

    version: int
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        owner = "rlfleet update_info"
        _require(
            _is_int(self.version) and 0 <= self.version < 2**63,
            owner,
            "version",
            self.version,
            "an int in [0, 2**63)",
        )
        _require(
            self.timeout_s is None or _positive(self.timeout_s),
            owner,
            "timeout_s",
            self.timeout_s,
            "a finite number > 0 or None",
        )


@dataclass
class VllmTrainerInitInfo:
    """The trainer's side (``WeightTransferTrainerFactory.trainer_init``, on every trainer rank).

    `workers`: the vLLM worker processes that receive (tensor x pipeline parallel size, times
    the data-parallel engines fed from this node buffer or group). Rank 0 is the sender: it
    makes the node buffer (`transport` "node", on the engine's node) or hosts the store and the
    group (`transport` "broadcast", at `store_host`:`store_port`, 0 for any free port).
    `finish_retries`: how often a failed ``finish_weight_update`` is retried (vLLM keeps the
    update open until one succeeds).
    """

    backend: ClassVar[str] = VLLM_BACKEND

    workers: int
    transport: str = "node"
    bucket_bytes: int = 64 << 20
    timeout_s: float = 300.0
    checksums: bool = True
    rename_prefix: tuple[str, str] | None = None
    store_host: str = "127.0.0.1"
    store_port: int = 0
    wire: str = "gloo"
    finish_retries: int = 1
    rank: int = field(kw_only=True)

    def __post_init__(self) -> None:
        owner = "rlfleet trainer init_info"
        _require(_is_int(self.workers) and self.workers >= 1, owner, "workers", self.workers, "an int >= 1")
        _require(self.transport in TRANSPORTS, owner, "transport", self.transport, f"one of {TRANSPORTS}")
        _require(
            _is_int(self.bucket_bytes) and self.bucket_bytes >= 512,
            owner,
            "bucket_bytes",
            self.bucket_bytes,
            "an int >= 512",
        )
        _require(_positive(self.timeout_s), owner, "timeout_s", self.timeout_s, "a finite number > 0")
        _require(
            _is_int(self.finish_retries) and self.finish_retries >= 0,
            owner,
            "finish_retries",
            self.finish_retries,
            "an int >= 0",
        )
        _require(_is_int(self.rank) and self.rank >= 0, owner, "rank", self.rank, "an int >= 0")
        _require(self.wire in WIRES, owner, "wire", self.wire, f"one of {WIRES}")
        _prefix(self.rename_prefix, owner)

    @property
    def is_sender(self) -> bool:
        return self.rank == 0


def register_vllm_backend() -> None:
    """Register the "rlfleet" engine and trainer with vLLM's factories (idempotent).

    vLLM's ``register_engine`` raises ValueError on a name it knows; a second registration (the
    plugin runs in every process, possibly twice) is therefore a no-op. The classes are
    registered by module path: vLLM imports them only when it builds one.
    """
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
        (WeightTransferEngineFactory, "rlfleet.weightsync.engines._vllm", "VllmWeightTransferEngine"),
        (
            WeightTransferTrainerFactory,
            "rlfleet.weightsync.engines._vllm_trainer",
            "VllmTrainerWeightTransferEngine",
        ),
    ):
        try:
            factory.register_engine(VLLM_BACKEND, module, cls)
        except ValueError:
            _log.debug("vLLM %s already knows backend %r", factory.__name__, VLLM_BACKEND)


def reload_vllm_weights(
    model: torch.nn.Module,
    model_config: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    target_device: torch.device | None = None,
) -> Any:
    """Load checkpoint-format `weights` into a vLLM `model` in place, with vLLM's reload path.

    vLLM's layerwise reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``)
    buffers each layer's weights and runs its post-load processing (quantized layers, attention)
    once the layer is complete, which ``load_weights`` on an already processed model does not.
    Finalized even when ``load_weights`` raises: otherwise the parameters stay on the meta device.
    Without that path (older vLLM): ``load_weights`` then vLLM's function
    ``process_weights_after_loading(model, model_config, target_device)``.
    """
    loader: Any = model  # a vLLM model class: load_weights is its own method
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        result = loader.load_weights(weights)
        device = target_device if target_device is not None else next(model.parameters()).device
        process_weights_after_loading(model, model_config, device)
        return result
    initialize_layerwise_reload(model)
    try:
        return loader.load_weights(weights)
    finally:
        finalize_layerwise_reload(model, model_config)


def run_together(calls: Sequence[Callable[[], Any]], timeout_s: float, what: str) -> list[Any]:
    """Run `calls` at once (daemon threads); their results, or the first error as soon as it happens.

    A trainer's half of a rendezvous and the engine's half (an RPC) block on each other: run in
    turn, an engine that fails at once would leave the trainer waiting out its whole timeout,
    its error hidden behind a rendezvous timeout. A call still running when another failed is
    left to its own deadline (its thread is a daemon). `SyncTimeoutError` names `what` when
    `timeout_s` passes first.
    """
    done: queue.Queue[tuple[int, bool, Any]] = queue.Queue()

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            done.put((index, True, call()))
        except BaseException as exc:
            done.put((index, False, exc))

    for index, call in enumerate(calls):
        threading.Thread(target=run, args=(index, call), name=f"rlfleet-{what}-{index}", daemon=True).start()
    results: list[Any] = [None] * len(calls)
    end = time.monotonic() + timeout_s
    for _ in calls:
        try:
            index, ok, value = done.get(timeout=max(end - time.monotonic(), 0.0))
        except queue.Empty:
            raise SyncTimeoutError(f"{what}: not done within {timeout_s:.1f}s") from None
        if not ok:
            raise value
        results[index] = value
    return results
