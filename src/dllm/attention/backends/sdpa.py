"""SDPA backend: no mask or `is_causal` when the pattern allows it, else a dense boolean mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask, dense_mask, mask_mod


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> [B, H, Lq, D]."""
    gqa = k.shape[1] != q.shape[1]
    if mask.is_plain:
        causal = mask.kind == "causal"
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dense = dense_mask(mask_mod(mask), q.shape[0], q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
