"""A small decoder-only transformer in plain torch, with Llama's parameter names.

The names (``model.layers.0.self_attn.q_proj.weight`` ...) are what an inference engine's
``load_weights`` expects from a Hugging Face Llama checkpoint, so the same weights could be
streamed into vLLM or SGLang (see examples/integrations/). Positions are learned embeddings
(no rotary): the task is short and fixed-length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LMConfig:
    vocab: int = 11  # digits 0-9 and the separator
    context: int = 17  # prompt (digits + separator) and answer
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2  # grouped-query attention, as Llama
    layers: int = 2
    intermediate: int = 128


class Attention(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return projected


class MLP(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class Decoder(nn.Module):
    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
        self.embed_positions = nn.Embedding(cfg.context, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)


class TinyLM(nn.Module):
    """``model.*`` and ``lm_head``: the layout of a Llama causal LM, at toy size."""

    def __init__(self, cfg: LMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.model.embed_tokens(tokens) + self.model.embed_positions(positions)
        for layer in self.model.layers:
            x = layer(x)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


def answer_logprobs(model: nn.Module, sequences: torch.Tensor, prompt_len: int, choices: int) -> torch.Tensor:
    """Log-probabilities of the answer tokens of `sequences` ([N, prompt + answer]) under `model`,
    the answer restricted to the first `choices` tokens (the digits)."""
    logits = model(sequences[:, :-1])[:, prompt_len - 1 :, :choices]
    answer = sequences[:, prompt_len:]
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, answer.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def sample_answers(
    model: nn.Module, prompts: torch.Tensor, length: int, choices: int, generator: torch.Generator
) -> torch.Tensor:
    """Sample `length` answer tokens after each prompt (temperature 1, first `choices` tokens)."""
    sequences = prompts
    for _ in range(length):
        logits = model(sequences)[:, -1, :choices].float()
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        sequences = torch.cat([sequences, token], dim=1)
    return sequences[:, prompts.shape[1] :]
