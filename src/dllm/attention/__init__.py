"""Attention patterns (pure mask functions) and the backends that compute attention under them."""

from dllm.attention.masks import AttentionMask

__all__ = ["AttentionMask"]
