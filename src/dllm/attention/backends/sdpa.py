"""SDPA backend (the reference): no mask or `is_causal` when the pattern allows it, else a dense boolean mask."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask, dense_mask, mask_mod


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D] -> [B, H, Lq, D]."""
    gqa = k.shape[1] != q.shape[1]
    plain_causal = mask.is_plain and mask.kind == "causal"  # is_causal would cut the packed rows apart
    if gqa and q.shape[2] == 1 and q.device.type == "cpu" and q.dtype in HALF and not plain_causal:
        return _one_query_packed(q, k, v, mask)
    if mask.is_plain:
        causal = mask.kind == "causal"
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    dense = sdpa_mask(mask, q.shape[0], q.shape[2], k.shape[2], q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)


HALF = (torch.bfloat16, torch.float16)


def _one_query_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """One query a row (a decoding step) with grouped key/value heads, in bf16 or f16 on CPU: the query heads
    that share a key/value head become that head's query rows, q [B, H, 1, D] -> [B, Hkv, H / Hkv, D] (head h
    reads key/value head h // (H / Hkv), as enable_gqa does), so the kernel runs Hkv heads of H / Hkv rows
    instead of H heads of one row. CPU's bf16 kernel is 3-5x faster so at SmolLM2's 9 / 3 heads (bench/bf16.py);
    in float32 it gains nothing and would change the last bits, so float32 keeps the plain call. Every row
    reads the same keys: the mask [B, 1, 1, Lk] broadcasts over them."""
    B, H, _, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    dense = None if mask.is_plain else sdpa_mask(mask, B, 1, Lk, q.device)
    out = F.scaled_dot_product_attention(q.reshape(B, Hkv, H // Hkv, D), k, v, attn_mask=dense)
    return out.reshape(B, H, 1, D)


def sdpa_mask(mask: AttentionMask, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """Dense bool [B, 1, Lq, Lk] from the shared mask function, built once per description and shape."""
    key = ("sdpa", batch, q_len, kv_len, device)
    return mask.cache.memo(key, lambda: dense_mask(mask_mod(mask, kv_len), batch, q_len, kv_len, device))


def sdpa_backend(flex_compile: bool) -> Callable[..., torch.Tensor]:
    """The registered factory of `sdpa` (no options)."""
    return sdpa_attention
