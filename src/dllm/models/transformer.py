"""The native transformer: one single-device block stack (RMSNorm, RoPE, SwiGLU, GQA).

It is used with bidirectional attention for masked diffusion and knows nothing about meshes,
objectives or samplers; parallelism is applied from outside (dllm.parallel.apply).

Shapes: B batch, L sequence, V vocabulary, H heads, K key/value heads, D head width, E hidden width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention.backends import ATTENTION_BACKENDS
from dllm.attention.masks import AttentionMask
from dllm.config.spec import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 for stability under autocast, as LLaMA does
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_cos_sin(positions_BL: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, L, D] for the rotate-half RoPE convention (Hugging Face LLaMA layout)."""
    freqs = positions_BL.float()[..., None] * inv_freq.float()[None, None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, H, K, D = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        self.num_heads, self.num_kv_heads, self.head_dim = H, K, D
        self.q_proj = nn.Linear(E, H * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(E, K * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(E, K * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(H * D, E, bias=False)
        self.q_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(D, cfg.norm_eps) if cfg.qk_norm else None
        self.attend = ATTENTION_BACKENDS.get(cfg.attention_backend)

    def forward(self, x_BLE: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        B, L, _ = x_BLE.shape
        q = self.q_proj(x_BLE).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BLE).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BLE).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out_BHLD = self.attend(q, k, v, mask)
        return self.o_proj(out_BHLD.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.mlp_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.mlp_size, bias=False)
        self.down_proj = nn.Linear(cfg.mlp_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """tokens [B, L] + positions [B, L] + mask -> logits [B, L, V] (or hidden [B, L, E])."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.vocab_size is not None, "resolve model.vocab_size from the tokenizer first"
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        D = cfg.dim_per_head
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)
        assert D % 2 == 0

    def _inv_freq(self) -> torch.Tensor:
        D = self.cfg.dim_per_head
        return 1.0 / (self.cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))

    def forward(
        self,
        tokens_BL: torch.Tensor,
        positions_BL: torch.Tensor,
        mask: AttentionMask | None = None,
        cache: Any = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        assert cache is None, "KV caches arrive with the sampling issue"
        mask = mask if mask is not None else AttentionMask()
        cos, sin = rope_cos_sin(positions_BL, self.inv_freq)
        x = self.embed_tokens(tokens_BL)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        x = self.norm(x)
        return x if return_hidden else self.logits(x)

    def logits(self, hidden_BLE: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden_BLE, weight)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Normal(0, init_std) weights; residual output projections scaled by 1/sqrt(2 * layers)
        (GPT-2 / Megatron practice) so the residual stream does not grow with depth."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float32) * s)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute non-persistent buffers (after `to_empty` from the meta device)."""
        self.inv_freq.copy_(self._inv_freq().to(self.inv_freq.device))

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Parameter count; `exclude_embeddings` leaves out the embedding and an untied LM head."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed_tokens.weight.numel()
            n -= self.lm_head.weight.numel() if self.lm_head is not None else 0
        return n


def train_flops_per_token(cfg: ModelConfig, num_params_no_embed: int, seq_len: int) -> float:
    """Model FLOPs per trained token: 6 N (dense matmuls, forward + backward; N without embedding
    and head) + attention scores and values 12 * layers * heads * head_dim * seq_len (PaLM
    appendix B) + the LM head 6 * hidden * vocab."""
    assert cfg.vocab_size is not None
    head = 6 * cfg.hidden_size * cfg.vocab_size
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.dim_per_head * seq_len
    return 6 * num_params_no_embed + attn + head
