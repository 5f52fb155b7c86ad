"""Tokenizers: `build_tokenizer(TokenizerConfig)` is the one way to get one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dllm.tokenization.base import ChatEncoding, Tokenizer
from dllm.tokenization.byte import ByteTokenizer

if TYPE_CHECKING:
    from dllm.config.data import TokenizerConfig

__all__ = ["ByteTokenizer", "ChatEncoding", "Tokenizer", "build_tokenizer"]


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    if cfg.kind == "byte":
        return ByteTokenizer()
    from dllm.tokenization.hf import HFTokenizer

    assert cfg.path is not None  # guaranteed by TokenizerConfig validation
    return HFTokenizer(cfg.path, mask_token=cfg.mask_token)
