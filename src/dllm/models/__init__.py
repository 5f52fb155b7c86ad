"""Models: the native transformer and its registry (families arrive as config presets)."""

from __future__ import annotations

from dllm.models.transformer import Transformer
from dllm.registry import Registry

# every family is the one native Transformer with other layout fields (see families.py)
MODELS: Registry[type] = Registry("model family")
for _family in ("llama", "qwen2", "qwen3", "qwen3_moe", "llada", "dream", "gpt2", "bert"):
    MODELS.add(_family, Transformer)

__all__ = ["MODELS", "Transformer"]
