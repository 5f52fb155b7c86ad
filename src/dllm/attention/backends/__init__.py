"""Attention backends, chosen by `model.attention_backend` and built from the model's options.

A backend is a callable `(q_BHLD, k_BKSD, v_BKSD, mask) -> out_BHLD`; k/v may have fewer heads
than q (grouped-query attention). `sdpa` is the reference (dense mask); `flex` uses FlexAttention
with a BlockMask; `blockwise` computes block masks exactly with SDPA over block-aligned query chunks
(the CPU training fast path); `auto` picks one of them per call (see backends/auto.py). The registry
holds factories: `make_attention(name, flex_compile)` builds the callable, so options such as
`model.flex_compile` reach a backend as arguments, never through the environment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm.attention.backends.auto import AutoBackend
from dllm.attention.backends.blockwise import blockwise_attention
from dllm.attention.backends.flex import FlexBackend
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask
from dllm.registry import Registry

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]
AttentionFactory = Callable[[bool], AttentionFn]  # flex_compile -> backend
ATTENTION_BACKENDS: Registry[AttentionFactory] = Registry("attention backend")
ATTENTION_BACKENDS.add("sdpa", lambda flex_compile: sdpa_attention)
ATTENTION_BACKENDS.add("flex", lambda flex_compile: FlexBackend(compiled=flex_compile))
ATTENTION_BACKENDS.add("blockwise", lambda flex_compile: blockwise_attention)
ATTENTION_BACKENDS.add("auto", lambda flex_compile: AutoBackend(flex_compile=flex_compile))


def make_attention(name: str, flex_compile: bool) -> AttentionFn:
    """The backend `name` (model.attention_backend) built with the model's options; raises on an unknown name."""
    return ATTENTION_BACKENDS.get(name)(flex_compile)


__all__ = ["ATTENTION_BACKENDS", "AttentionFactory", "AttentionFn", "make_attention"]
