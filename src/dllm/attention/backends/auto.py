"""`auto` backend: per call, the fastest backend that can compute it.

- plain bidirectional/causal: SDPA without a mask tensor (fused no-mask / is_causal kernels);
- structured mask on CUDA: FlexAttention (BlockMask sparsity, forward and backward);
- block_causal / block_diffusion mask on CPU: `blockwise`, exact SDPA calls over block-aligned query
  chunks. FlexAttention has no CPU backward, and the dense mask scores all 4*L*L pairs of BD3LM's 2L
  layout while blockwise scores ~L*L*(S+3)/S: 1.9-2.2x faster forward + backward and 2.6-2.9x faster
  forward than dense, and faster forward than compiled FlexAttention too (bench/attention.py, 2L =
  1024 and 2048), with no compile;
- other structured masks (documents, padding, windows) on CPU: SDPA with a dense mask. Compiled
  FlexAttention is faster on big masks but costs ~30 s per new shape, more than a CPU sampling call;
  choose `flex` explicitly for long CPU jobs;
- FlexAttention configured eager (model.flex_compile: false) or any other device: SDPA. Eager
  FlexAttention materialises every score and ran ~6x slower than dense SDPA on the block-diffusion mask.

Shapes: B batch, H query heads, K key/value heads, L query length, S key length, D head width.
"""

from __future__ import annotations

from typing import Literal

import torch

from dllm.attention.backends.blockwise import blockwise_attention
from dllm.attention.backends.flex import FlexBackend, needs_grad
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import BLOCK_KINDS, AttentionMask


def choose_backend(
    mask: AttentionMask, device_type: str, grad: bool, flex_compile: bool
) -> Literal["sdpa", "flex", "blockwise"]:
    """Which backend `auto` uses for a mask on a device, with or without gradients."""
    if mask.is_plain:
        return "sdpa"
    if device_type == "cpu":
        # no CPU flex backward; blockwise skips most of BD3LM's masked pairs, exactly, and compiles nothing
        return "blockwise" if mask.kind in BLOCK_KINDS else "sdpa"
    if device_type == "cuda" and flex_compile:
        return "flex"
    return "sdpa"


class AutoBackend:
    """The `auto` backend: q [B, H, L, D], k/v [B, K, S, D] -> [B, H, L, D] with the backend `choose_backend` picks."""

    def __init__(self, flex_compile: bool = True) -> None:
        self.flex_compile = flex_compile
        self.flex = FlexBackend(compiled=flex_compile)

    def __call__(self, q_BHLD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask):
        grad = needs_grad(q_BHLD, k_BKSD, v_BKSD)
        backend = choose_backend(mask, q_BHLD.device.type, grad, self.flex_compile)
        if backend == "flex":
            return self.flex(q_BHLD, k_BKSD, v_BKSD, mask)
        if backend == "blockwise":
            return blockwise_attention(q_BHLD, k_BKSD, v_BKSD, mask)
        return sdpa_attention(q_BHLD, k_BKSD, v_BKSD, mask)
