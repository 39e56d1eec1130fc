"""The engine-side signatures the recipes call, as Protocols, so mypy checks the recipes.

Neither vLLM nor SGLang is installed here (no GPU): these Protocols restate their documented
signatures, and the recipes are written against them. Sources:

- vLLM model classes: ``load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]``
  ("Implementing a basic model", https://docs.vllm.ai/en/latest/contributing/model/basic.html);
  the worker extension mechanism (``LLM(..., worker_extension_cls="pkg.mod.Class")``, its methods
  called on every worker with ``LLM.collective_rpc(method, timeout=None, args=(), kwargs=None)``,
  inside which ``self.model_runner.get_model()`` is the model (``runner.model`` may be a
  CUDA-graph wrapper on a GPU) and ``self.device`` its device):
  https://docs.vllm.ai/en/latest/api/vllm/entrypoints/llm.html and the RLHF example,
  https://docs.vllm.ai/en/latest/examples/offline_inference/rlhf.html. Checked against vLLM
  0.33.0's source (``vllm/v1/worker/gpu_worker.py``, ``gpu_model_runner.py``) and run against it
  on the CPU by ``tests/e2e/test_vllm.py -m vllm``.
- SGLang ``Engine``: ``update_weights_from_tensor``, ``init_weights_update_group``,
  ``update_weights_from_distributed``, ``flush_cache`` ("SGLang for RL Systems",
  https://docs.sglang.io/advanced_features/sglang_for_rl.html; signatures as defined in
  ``python/sglang/srt/entrypoints/engine.py``, read at commit 001067f of sgl-project/sglang:
  ``update_weights_from_tensor(self, named_tensors: Union[List[Tuple[str, torch.Tensor]],
  List[SerializedTensorPayload]], load_format: Optional[str] = None, flush_cache: bool = True)``;
  with ``load_format="flattened_bucket"`` the list holds one serialized
  ``{"flattened_tensor", "metadata"}`` payload per tensor-parallel rank). SGLang is not
  installable here: nothing of it runs in this project's tests.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch


class VllmModel(Protocol):
    """A vLLM model class (e.g. ``LlamaForCausalLM``): stacks q/k/v and gate/up itself."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...


class VllmModelRunner(Protocol):
    model: VllmModel
    model_config: Any

    def get_model(self) -> Any: ...


class VllmWorker(Protocol):
    """What ``self`` is inside a worker extension's method (the extension is mixed into it)."""

    model_runner: VllmModelRunner
    device: torch.device


class VllmLLM(Protocol):
    """``vllm.LLM``: calls a worker-extension method on every worker, returns their results."""

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]: ...


class SglangEngine(Protocol):
    """``sglang.Engine`` (offline engine), the refit calls."""

    def update_weights_from_tensor(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | list[Any],
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> Any: ...

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> Any: ...

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> Any: ...

    def flush_cache(self) -> Any: ...
