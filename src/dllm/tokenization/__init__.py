"""Tokenizers: `build_tokenizer(TokenizerConfig)` is the one way to get one."""

from __future__ import annotations

from dllm.config.data import TokenizerConfig
from dllm.config.registries import TOKENIZERS
from dllm.tokenization.base import ChatEncoding, Tokenizer, max_chars_per_token
from dllm.tokenization.byte import ByteTokenizer

__all__ = ["ByteTokenizer", "ChatEncoding", "Tokenizer", "build_tokenizer", "max_chars_per_token"]


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer `cfg.kind` names (TOKENIZERS), built from its section; hf is imported only when used."""
    return TOKENIZERS.resolve(cfg.kind)(cfg)
