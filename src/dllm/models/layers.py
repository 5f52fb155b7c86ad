"""The small interchangeable layers the transformer is assembled from: norms and activations.

Each is registered by name in dllm.config.registries (NORMS, ACTIVATIONS); the transformer resolves
`model.norm` and `model.activation` once, when it is built. A norm class is built with
`cls.of(cfg, dim)`; an activation is a function of one tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.config.model import ModelConfig


class RMSNorm(nn.Module):
    offset = 0.0
    """The scale is offset + weight; a fresh norm (scale 1) has weight 1 - offset."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.offset))

    @classmethod
    def of(cls, cfg: ModelConfig, dim: int) -> RMSNorm:
        return cls(dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 for stability under autocast, as LLaMA does
        if self.offset:
            scale = self.weight.float() + self.offset
            return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * scale).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class CenteredRMSNorm(RMSNorm):
    """RMSNorm whose scale is 1 + weight (Qwen3.5, Gemma): the weight is stored, initialised and decayed
    around 0; the checkpoints' values load unchanged."""

    offset = 1.0


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float, bias: bool) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    @classmethod
    def of(cls, cfg: ModelConfig, dim: int) -> LayerNorm:
        return cls(dim, cfg.norm_eps, cfg.norm_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), bias, self.eps).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (GPT-2's `gelu_new`)."""
    return F.gelu(x, approximate="tanh")
