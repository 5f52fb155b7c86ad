"""Attention backends, chosen by `model.attention_backend`.

A backend is a callable `(q_BHLD, k_BKSD, v_BKSD, mask) -> out_BHLD`; k/v may have fewer heads
than q (grouped-query attention). `sdpa` is the reference (dense mask); `flex` uses FlexAttention
with a BlockMask; `blockwise` computes block masks exactly with SDPA over block-aligned query chunks
(the CPU training fast path); `auto` picks one of them per call (see backends/auto.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm.attention.backends.auto import auto_attention
from dllm.attention.backends.blockwise import blockwise_attention
from dllm.attention.backends.flex import flex_attention_backend
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask
from dllm.registry import Registry

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]
ATTENTION_BACKENDS: Registry[AttentionFn] = Registry("attention backend")
ATTENTION_BACKENDS.add("sdpa", sdpa_attention)
ATTENTION_BACKENDS.add("flex", flex_attention_backend)
ATTENTION_BACKENDS.add("blockwise", blockwise_attention)
ATTENTION_BACKENDS.add("auto", auto_attention)

__all__ = ["ATTENTION_BACKENDS", "AttentionFn"]
