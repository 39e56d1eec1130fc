"""NeMo RL's ``get_reference_policy_logprobs``: log-probs under a frozen copy of the policy.

The copy is made at the first call and kept until the training state is replaced (the reference
policy is the one training started from). How a model turns data into logits is the host's
`policy_logits` hook.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rlfleet.policygroup.worker._host import WorkerHost

Logits = Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor]


def reference_logprobs(
    model: torch.nn.Module, data: Mapping[str, Any], logits: Logits, micro_batch_size: int | None = None
) -> torch.Tensor:
    """Log-probs of `data`'s actions under `model`, `micro_batch_size` rows at a time (CPU tensor).

    `data["actions"]` ([B] or [B, T]) with `obs`: log-prob of each action. `input_ids` alone
    ([B, T]): NeMo's convention, token i scored by the logits at i-1, position 0 is 0.
    """
    n = int(data["obs" if "obs" in data else "input_ids"].shape[0])
    mb = micro_batch_size or n or 1
    outs = []
    with torch.no_grad():
        for start in range(0, n, mb):
            part = {k: (v[start : start + mb] if torch.is_tensor(v) else v) for k, v in data.items()}
            logp = torch.log_softmax(logits(model, part).float(), dim=-1)
            if "actions" in part:
                actions = part["actions"].to(logp.device).long()
                outs.append(logp.gather(-1, actions.unsqueeze(-1)).squeeze(-1))
            else:
                ids = part["input_ids"].to(logp.device).long()
                scored = logp[:, :-1].gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
                outs.append(torch.cat([torch.zeros_like(scored[:, :1]), scored], dim=1))
    return torch.cat(outs).cpu()


class ReferenceCalls(WorkerHost):
    """The reference policy's log-probs (NeMo RL's call), with the `policy_logits` hook."""

    def policy_logits(self, model: torch.nn.Module, data: Mapping[str, Any]) -> torch.Tensor:
        """Logits of `model` for `data` (default: `model(data["obs"])` or `model(data["input_ids"])`)."""
        x = data["obs"] if "obs" in data else data["input_ids"]
        out: torch.Tensor = model(x.to(self.device))
        return out

    def get_reference_policy_logprobs(
        self, *, data: Mapping[str, Any], micro_batch_size: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Log-probs of `data`'s actions under the frozen reference copy of the policy
        (`reference_logprobs` says how actions and token ids are scored)."""
        if self._ref_model is None:
            self._ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        logprobs = reference_logprobs(self._ref_model, data, self.policy_logits, micro_batch_size)
        return {"reference_logprobs": logprobs}
