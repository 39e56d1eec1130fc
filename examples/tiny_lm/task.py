"""The verifiable task: reverse a string of digits. The reward is the fraction of answer
positions that are right, so chance is 0.1 and a perfect policy scores 1.0."""

from __future__ import annotations

import torch

DIGITS = 10
SEPARATOR = 10


def make_prompts(count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`count` prompts: `length` random digits, then the separator."""
    digits = torch.randint(0, DIGITS, (count, length), generator=generator)
    return torch.cat([digits, torch.full((count, 1), SEPARATOR)], dim=1)


def rewards(prompts: torch.Tensor, answers: torch.Tensor) -> torch.Tensor:
    """Per answer: the fraction of positions equal to the reversed prompt digits."""
    target = prompts[:, :-1].flip(1)
    return (answers == target).float().mean(dim=1)


def group_advantages(reward: torch.Tensor, group: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each answer's reward against the mean and spread of its own prompt's group."""
    grouped = reward.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    return (centred / (grouped.std(dim=1, keepdim=True) + eps)).view(-1)
