"""SDPA backend (the reference): no mask or `is_causal` when the pattern allows it, else a dense boolean mask."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask, dense_mask, mask_mod


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> [B, H, Lq, D]."""
    gqa = k.shape[1] != q.shape[1]
    if mask.is_plain:
        causal = mask.kind == "causal"
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dense = sdpa_mask(mask, q.shape[0], q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)


def sdpa_mask(mask: AttentionMask, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Dense bool [B, 1, Lq, Lk] from the shared mask function, built once per description and shape."""
    key = ("sdpa", batch, q_len, kv_len, device)
    return mask.cache.memo(key, lambda: dense_mask(mask_mod(mask, kv_len), batch, q_len, kv_len, device))


def sdpa_backend(flex_compile: bool) -> Callable[..., torch.Tensor]:
    """The registered factory of `sdpa` (no options)."""
    return sdpa_attention
