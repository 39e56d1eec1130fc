"""Offload and reload of a worker's model, gradients and optimizer state (the seed's calls).

On a GPU worker they move to host memory and back. The copies are issued non-blocking and the
device is synchronized before the call returns, so nothing reads host memory a copy is still
writing, and what offload freed goes back to the device (torch's cache is emptied). On a CPU
worker there is nothing to move: the calls only record the state. A module bound to its node's
shared buffer ("Shared") stays where it is: it holds no device memory of its own.
"""

from __future__ import annotations

import torch

STATES = ("model", "optimizer", "grad")


def _settle(device: torch.device) -> None:
    """Wait for the copies issued on `device`, then return freed blocks to the device."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class Offload:
    """Where a worker's model, gradients and optimizer state are: `state()` says what is offloaded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._offloaded = dict.fromkeys(STATES, False)

    def state(self) -> dict[str, bool]:
        return dict(self._offloaded)

    def model(self, module: torch.nn.Module, to_host: bool, pinned_in_place: bool = False) -> None:
        """Move the whole module (eval workers); `pinned_in_place`: bound to shared memory, stays."""
        if self.device.type != "cpu" and not pinned_in_place:
            module.to("cpu" if to_host else self.device)
            _settle(self.device)
        self._offloaded["model"] = to_host

    def optimizer(self, optimizer: torch.optim.Optimizer | None, to_host: bool) -> None:
        target = torch.device("cpu") if to_host else self.device
        if optimizer is not None and self.device.type != "cpu":
            for state in optimizer.state.values():
                for key, value in state.items():
                    if torch.is_tensor(value) and value.device != target:
                        state[key] = value.to(target, non_blocking=True)
            _settle(self.device)
        self._offloaded["optimizer"] = to_host

    def params_and_grads(self, module: torch.nn.Module, to_host: bool, grads: bool = True) -> None:
        """Move parameters (and, with `grads`, their gradients) of a trainer's module."""
        target = torch.device("cpu") if to_host else self.device
        if self.device.type != "cpu":
            for param in module.parameters():
                param.data = param.data.to(target, non_blocking=True)
                if grads and param.grad is not None:
                    param.grad = param.grad.to(target, non_blocking=True)
            _settle(self.device)
        self._offloaded["model"] = to_host
        self._offloaded["grad"] = to_host and grads
