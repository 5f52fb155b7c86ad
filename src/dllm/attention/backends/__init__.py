"""Attention backends, chosen by `model.attention_backend` and built from the model's options.

A backend is a callable `(q_BHLD, k_BKSD, v_BKSD, mask) -> out_BHLD`; k/v may have fewer heads
than q (grouped-query attention). `sdpa` is the reference (dense mask); `flex` uses FlexAttention
with a BlockMask; `blockwise` computes block masks exactly with SDPA over block-aligned query chunks
(the CPU training fast path); `auto` picks one of them per call (see backends/auto.py). The registry
(ATTENTION_BACKENDS in dllm.config.registries) names each backend's factory, `(flex_compile) ->
backend`, so options such as `model.flex_compile` reach a backend as arguments, never through the
environment.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.registries import ATTENTION_BACKENDS

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMask], torch.Tensor]
AttentionFactory = Callable[[bool], AttentionFn]  # flex_compile -> backend


def make_attention(name: str, flex_compile: bool) -> AttentionFn:
    """The backend `name` (model.attention_backend) built with the model's options; raises on an unknown name."""
    factory: AttentionFactory = ATTENTION_BACKENDS.resolve(name)
    return factory(flex_compile)


__all__ = ["AttentionFactory", "AttentionFn", "make_attention"]
