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
