"""ByteTokenizer: UTF-8 bytes as ids 0..255 plus four special ids; needs no files."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dllm.text import valid_text
from dllm.tokenization.base import ChatEncoding, sha256_json

if TYPE_CHECKING:
    from dllm.config.data import TokenizerConfig

# A deliberately plain chat template: role headers as text, the turn closed by EOS.
_ROLE_HEADER = {"system": "System: ", "user": "User: ", "assistant": "Assistant: "}


class ByteTokenizer:
    """Bytes 0..255, then pad, bos, eos, mask. Decoding replaces invalid UTF-8."""

    kind = "byte"
    num_bytes = 256

    @classmethod
    def from_config(cls, cfg: TokenizerConfig) -> ByteTokenizer:
        """The registered constructor of kind `byte` (no options)."""
        return cls()

    def __init__(self) -> None:
        self.pad_id = 256
        self.bos_id: int | None = 257
        self.eos_id = 258
        self.mask_id = 259
        self.vocab_size = 260
        self._special = {
            self.pad_id: "<|pad|>",
            self.bos_id: "<|bos|>",
            self.eos_id: "<|eos|>",
            self.mask_id: "<|mask|>",
        }

    def encode(self, text: str) -> list[int]:
        return list(valid_text(text).encode("utf-8"))

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < self.num_bytes:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special:
                out.append(self._special.get(i, f"<|{i}|>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = False) -> ChatEncoding:
        """`Role: content` per turn, each turn ending in a newline; assistant turns end in EOS.

        The assistant mask covers the assistant's content and its EOS (what a model must learn to
        write), not the `Assistant: ` header.
        """
        ids: list[int] = []
        mask: list[int] = []
        for msg in messages:
            role = msg.get("role")
            if role not in _ROLE_HEADER:
                raise ValueError(f"unknown chat role {role!r}; expected one of {', '.join(_ROLE_HEADER)}")
            header = self.encode(_ROLE_HEADER[role])
            body = self.encode(str(msg.get("content", "")))
            ids += header
            mask += [0] * len(header)
            if role == "assistant":
                ids += body + [self.eos_id]
                mask += [1] * (len(body) + 1)
            else:
                nl = self.encode("\n")
                ids += body + nl
                mask += [0] * (len(body) + len(nl))
        if add_generation_prompt:
            header = self.encode(_ROLE_HEADER["assistant"])
            ids += header
            mask += [0] * len(header)
        return ChatEncoding(ids=ids, assistant_mask=mask)

    def identity(self) -> dict[str, Any]:
        specials = {"pad": self.pad_id, "bos": self.bos_id, "eos": self.eos_id, "mask": self.mask_id}
        return {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "vocab_hash": sha256_json(["byte-v1", self.num_bytes, sorted(self._special.items())]),
            "chat_template_hash": sha256_json(_ROLE_HEADER),
            "special_ids": specials,
        }
