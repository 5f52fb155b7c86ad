"""Models: the native transformer and its registry (families arrive as config presets)."""

from __future__ import annotations

from dllm.models.transformer import Transformer
from dllm.registry import Registry

MODELS: Registry[type] = Registry("model family")
MODELS.add("llama", Transformer)

__all__ = ["MODELS", "Transformer"]
