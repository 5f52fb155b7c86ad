"""`auto` backend: per call, the fastest backend that can compute it.

- plain bidirectional/causal: SDPA without a mask tensor (fused no-mask / is_causal kernels);
- structured mask on CUDA: FlexAttention (BlockMask sparsity, forward and backward);
- structured mask on CPU: FlexAttention when no gradient is needed (sampling, evaluation), SDPA with
  a dense mask when one is (FlexAttention has no CPU backward);
- FlexAttention forced eager (DLLM_FLEX_COMPILE=0) or any other device: SDPA. Eager FlexAttention
  materialises every score and ran ~6x slower than dense SDPA on the block-diffusion mask, while
  compiled it ran 1.4-2x faster (bench/attention.py, CPU, 2L = 1024 and 2048).

Shapes: B batch, H query heads, K key/value heads, L query length, S key length, D head width.
"""

from __future__ import annotations

from typing import Literal

import torch

from dllm.attention.backends.flex import compile_enabled, flex_attention_backend, needs_grad
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask


def choose_backend(mask: AttentionMask, device_type: str, grad: bool, flex_compiled: bool) -> Literal["sdpa", "flex"]:
    """Which backend `auto` uses for a mask on a device, with or without gradients."""
    if mask.is_plain or not flex_compiled:
        return "sdpa"
    if device_type == "cuda" or (device_type == "cpu" and not grad):
        return "flex"
    return "sdpa"


def auto_attention(q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask):
    """q [B, H, L, D], k/v [B, K, S, D] -> [B, H, L, D] with the backend `choose_backend` picks."""
    grad = needs_grad(q_BHLD, k_BKSD, v_BKSD)
    flex_compiled = torch.compiler.is_compiling() or compile_enabled()
    if choose_backend(mask, q_BHLD.device.type, grad, flex_compiled) == "flex":
        return flex_attention_backend(q_BHLD, k_BKSD, v_BKSD, mask)
    return sdpa_attention(q_BHLD, k_BKSD, v_BKSD, mask)
