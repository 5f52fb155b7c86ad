"""The tokenizer contract shared by the byte tokenizer and the Hugging Face adapter."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ChatEncoding:
    """Token ids of a rendered conversation and which of them the assistant wrote."""

    ids: list[int]
    assistant_mask: list[int] = field(default_factory=list)
    """1 where the token belongs to an assistant turn (from the template's spans, never guessed)."""


@runtime_checkable
class Tokenizer(Protocol):
    """What data preparation, training and sampling need from a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int
    mask_id: int
    bos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = False
    ) -> ChatEncoding: ...

    def identity(self) -> dict[str, Any]: ...


def sha256_json(obj: Any) -> str:
    """Stable hash of a JSON-serialisable object (sorted keys, no whitespace)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def max_chars_per_token(tok: Tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: twice its longest decoded form in bytes
    (a character is at least a byte; the factor 2 leaves room for decoders that drop a byte, a leading space,
    and normalizers that merge characters). Text of more than n times this many characters needs more than n
    tokens, which a caller may know without tokenizing it (only a normalizer that deletes most of a text breaks
    this). Decodes every id once."""
    longest = max(len(tok.decode([i], skip_special=False).encode("utf-8", "replace")) for i in range(tok.vocab_size))
    return 2 * max(longest, 1)
