"""Models: the one native transformer; a family (llama, qwen, gpt2, bert, ...) is a layout of its config
fields plus a weight-name map (the families/ package), registered in dllm.config.registries.FAMILIES."""

from __future__ import annotations

from dllm.models.transformer import Transformer

__all__ = ["Transformer"]
