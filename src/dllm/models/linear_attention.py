"""Gated DeltaNet: the linear-attention token mixer of hybrid models (Qwen3.5's `linear` layers).

    q, k, v = act(causal depthwise conv(in_proj_qkv x))     (W taps over the sequence, per channel)
    beta = sigmoid(in_proj_b x)                              (write strength per value head)
    g = -exp(A_log) softplus(in_proj_a x + dt_bias)          (log decay per value head, <= 0)
    o = gated delta rule(l2norm(q) / sqrt(K), l2norm(k), v, g, beta)   (models/gated_delta.py)
    out = out_proj(rmsnorm(o) * w * silu(in_proj_z x))       (a norm per value head, gated)

Key heads are shared by groups of value heads (each key head serves H / G consecutive value heads).
The parameter names are those of Hugging Face's Qwen3.5 checkpoints, so the family's weight map is 1:1.

Padding (`mask.key_valid_BL`): a padding position is a no-op token: its input is zeroed (no write, and
zeros to the convolution, as Hugging Face does) and its decay is 0, so the state passes through it
unchanged. Left padding is therefore exactly an unpadded row (the state is still zero after it), and
right padding changes nothing before it. The layers are causal: a mask kind other than causal, and
documents, are refused (one line).

Shapes: B batch, L sequence, E hidden width, H value heads, G key heads, K key width, V value width,
C convolution channels (2 G K + H V), W convolution taps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.config.registries import ACTIVATIONS
from dllm.models import gated_delta

CHUNK = 64
"""Tokens per chunk of the gated delta rule (any value gives the same result up to rounding)."""


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's V features, scaled by its weight, then gated by silu(z)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        E, W = cfg.hidden_size, cfg.linear_conv_kernel
        self.num_heads, self.num_key_heads = cfg.linear_value_heads, cfg.linear_key_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        GK, HV = self.num_key_heads * self.key_dim, self.num_heads * self.value_dim
        C = 2 * GK + HV
        self.in_proj_qkv = nn.Linear(E, C, bias=False)
        self.in_proj_z = nn.Linear(E, HV, bias=False)
        self.in_proj_b = nn.Linear(E, self.num_heads, bias=False)
        self.in_proj_a = nn.Linear(E, self.num_heads, bias=False)
        # a module for its weight [C, 1, W] (the checkpoints' layout); the forward pads causally itself
        self.conv1d = nn.Conv1d(C, C, W, groups=C, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(HV, E, bias=False)
        self.act = ACTIVATIONS.resolve(cfg.activation)

    def forward(self, x_BLE: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        valid_BL = _check_mask(mask, x_BLE.shape[1])
        if valid_BL is not None:
            x_BLE = x_BLE * valid_BL.unsqueeze(-1).to(x_BLE.dtype)
        B, L, _ = x_BLE.shape
        qkv_BLC = self._conv(self.in_proj_qkv(x_BLE))
        q, k, v = qkv_BLC.split([self.num_key_heads * self.key_dim] * 2 + [self.num_heads * self.value_dim], -1)
        q_BHLK, k_BHLK = (self._heads(t, self.key_dim) for t in (q, k))
        v_BHLV = self._heads(v, self.value_dim)
        g_BHL, beta_BHL = self._gates(x_BLE, valid_BL)
        q_BHLK = _l2norm(q_BHLK) * self.key_dim**-0.5
        o_BHLV, _ = gated_delta.chunked(q_BHLK, _l2norm(k_BHLK), v_BHLV, g_BHL, beta_BHL, chunk=CHUNK)
        z_BLHV = self.in_proj_z(x_BLE).view(B, L, self.num_heads, self.value_dim)
        o_BLHV = self.norm(o_BHLV.transpose(1, 2).to(x_BLE.dtype), z_BLHV)
        return self.out_proj(o_BLHV.reshape(B, L, -1))

    def _conv(self, x_BLC: torch.Tensor) -> torch.Tensor:
        """The causal depthwise convolution (zeros before the first token), then the activation."""
        W = self.conv1d.weight.shape[-1]
        x_BCL = F.pad(x_BLC.transpose(1, 2), (W - 1, 0))
        y_BCL = F.conv1d(x_BCL.to(self.conv1d.weight.dtype), self.conv1d.weight, groups=x_BCL.shape[1])
        return self.act(y_BCL).transpose(1, 2).to(x_BLC.dtype)

    def _heads(self, x_BLF: torch.Tensor, width: int) -> torch.Tensor:
        """[B, L, heads * width] -> [B, H, L, width], key heads repeated to the H value heads."""
        B, L, _ = x_BLF.shape
        x = x_BLF.view(B, L, -1, width).transpose(1, 2)
        return x.repeat_interleave(self.num_heads // x.shape[1], dim=1) if x.shape[1] != self.num_heads else x

    def _gates(self, x_BLE: torch.Tensor, valid_BL: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log decay g and write strength beta [B, H, L], in float32 (A = exp(A_log) would overflow in half)."""
        g_BLH = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x_BLE).float() + self.dt_bias.float())
        if valid_BL is not None:  # padding neither decays nor writes the state
            g_BLH = g_BLH * valid_BL.unsqueeze(-1)
        beta_BLH = torch.sigmoid(self.in_proj_b(x_BLE).float())
        return g_BLH.transpose(1, 2), beta_BLH.transpose(1, 2)


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), in float32 at least (the eps placement of the reference kernels)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)


def _check_mask(mask: AttentionMask, L: int) -> torch.Tensor | None:
    """The padding of a causal mask (None: none); anything a recurrent layer cannot honour is refused."""
    if mask.kind != "causal" or mask.doc_ids_BL is not None or mask.window is not None:
        raise ValueError(
            f"linear-attention layers run causally over one document; got a {mask.kind} mask"
            f"{' with documents' if mask.doc_ids_BL is not None else ''}: use a causal objective or an "
            "attention-only family"
        )
    if mask.query_offset or mask.query_offset_B is not None:
        raise ValueError("linear-attention layers keep no cache yet: run the whole sequence (no query offset)")
    valid = mask.key_valid_BL
    return None if valid is None else valid[:, :L]
