"""The user's side of the demo: a PPO policy and an environment worker, on rlfleet.

This is the part a team would write for its own stack. `CartPolePolicy` supplies the three
things rlfleet asks of a policy (the model, the rollout step, the training step); the policy
group does placement, weight sync, routing and the data-parallel gradient average.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from rlfleet.policygroup import BasePolicy, TrainConfig

OBS_DIM, N_ACTIONS = 4, 2


class ActorCritic(nn.Module):
    """Separate policy and value heads: small enough to train on a laptop core in seconds."""

    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.pi = nn.Sequential(
            nn.Linear(OBS_DIM, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, N_ACTIONS),
        )
        self.v = nn.Sequential(
            nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
        )

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.pi(obs)
        return logits


class CartPolePolicy(BasePolicy):
    """PPO (clipped objective, GAE computed by the driver) on CartPole-v1."""

    def build_model(self) -> nn.Module:
        return ActorCritic()

    def build_optimizer(self, train_config: TrainConfig | None) -> torch.optim.Optimizer:
        lr = train_config.lr if train_config is not None else 2.5e-3
        return torch.optim.Adam(self.model.parameters(), lr=lr)

    def rollout_step(self, env_ret: np.ndarray) -> dict[str, np.ndarray]:
        """One request = one env worker's batch of observations -> sampled actions."""
        model: Any = self.model
        obs = torch.as_tensor(env_ret, dtype=torch.float32)
        dist = torch.distributions.Categorical(logits=model.pi(obs))
        action = dist.sample()
        return {
            "action": action.numpy(),
            "logp": dist.log_prob(action).numpy(),
            "value": model.v(obs).squeeze(-1).numpy(),
            "version": np.int64(self.get_weight_version()),
        }

    def train_step(self, batch: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> dict[str, float]:
        """PPO epochs over this trainer's shard; gradients averaged over the train group."""
        assert self.optimizer is not None
        cfg = self.train_config.extra if self.train_config is not None else {}
        epochs, minibatches, clip = int(cfg.get("epochs", 4)), int(cfg.get("minibatches", 4)), 0.2
        model: Any = self.model
        n = len(batch["obs"])
        generator = torch.Generator().manual_seed(int(kwargs.get("seed", 0)))
        stats: dict[str, float] = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0}
        steps = 0
        for _ in range(epochs):
            for idx in torch.randperm(n, generator=generator).chunk(minibatches):
                dist = torch.distributions.Categorical(logits=model.pi(batch["obs"][idx]))
                adv = batch["adv"][idx]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8)
                ratio = (dist.log_prob(batch["action"][idx]) - batch["logp"][idx]).exp()
                policy_loss = -torch.min(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv).mean()
                value_loss = (model.v(batch["obs"][idx]).squeeze(-1) - batch["ret"][idx]).pow(2).mean()
                entropy = dist.entropy().mean()
                loss = policy_loss + 0.5 * value_loss - 0.01 * entropy
                self.optimizer.zero_grad()
                loss.backward()
                self.allreduce_gradients()  # data parallel over the train group (gloo here)
                nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                self.optimizer.step()
                stats["policy_loss"] += float(policy_loss)
                stats["value_loss"] += float(value_loss)
                stats["entropy"] += float(entropy)
                steps += 1
        return {k: v / max(steps, 1) for k, v in stats.items()}


class EnvWorker:
    """A vector of CartPole environments (run as a Ray actor), reporting finished episodes."""

    def __init__(self, num_envs: int, seed: int) -> None:
        self.envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(num_envs)])
        self.obs, _ = self.envs.reset(seed=seed)
        self.running = np.zeros(num_envs)

    def observe(self) -> np.ndarray:
        return np.asarray(self.obs, dtype=np.float32)

    def step(self, action: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[float]]:
        """Step every env; returns (next obs, reward, done, returns of episodes that ended)."""
        obs, reward, terminated, truncated, _ = self.envs.step(action)
        done = np.logical_or(terminated, truncated)
        self.running += reward
        finished = [float(r) for r in self.running[done]]
        self.running[done] = 0.0
        self.obs = obs
        return np.asarray(obs, dtype=np.float32), reward.astype(np.float32), done, finished


def gae(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    last_value: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimates and returns for arrays shaped [steps, envs]."""
    adv = np.zeros_like(rewards)
    running = np.zeros_like(last_value)
    for t in reversed(range(len(rewards))):
        next_value = last_value if t == len(rewards) - 1 else values[t + 1]
        not_done = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        running = delta + gamma * lam * not_done * running
        adv[t] = running
    return adv, adv + values
