"""Attention backends, chosen by `model.attention_backend`.

A backend is a callable `(q_BHLD, k_BHLD, v_BHLD, mask) -> out_BHLD`; k/v may have fewer heads
than q (grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask
from dllm.registry import Registry

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]
ATTENTION_BACKENDS: Registry[AttentionFn] = Registry("attention backend")
ATTENTION_BACKENDS.add("sdpa", sdpa_attention)

__all__ = ["ATTENTION_BACKENDS", "AttentionFn"]
