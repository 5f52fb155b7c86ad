"""Render a record into a tokenized document with its supervision mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dllm.config.prepare import JsonlSourceConfig
from dllm.data.prepare.sources import Record
from dllm.errors import DataError
from dllm.tokenization import Tokenizer


@dataclass(frozen=True)
class Document:
    """Token ids of one document and which of them are training targets."""

    ids: list[int]
    loss_mask: list[int]


def get_field(data: dict[str, Any], dotted: str, where: str, option: str = "text_field") -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise DataError(f"{where}: record has no field {dotted!r}; set {option} in the source config")
        node = node[part]
    return node


def _string_field(record: Record, dotted: str, option: str) -> str:
    value = get_field(record.data, dotted, record.where, option)
    if not isinstance(value, str):
        raise DataError(f"{record.where}: field {dotted!r} is {type(value).__name__}, expected a string")
    return value


def _encode(tok: Tokenizer, text: str, record: Record) -> list[int]:
    try:
        return tok.encode(text)
    except UnicodeEncodeError:
        raise DataError(f"{record.where}: text holds characters that cannot be encoded (lone surrogates)") from None


def render(
    record: Record, src: JsonlSourceConfig, tok: Tokenizer, add_bos: bool, append_eos: bool, pad_to: int | None = None
) -> Document:
    """Token ids and loss mask of one record. A prompt that is not supervised is never noised in
    training: the objective only corrupts supervised tokens."""
    if src.format == "text":
        ids = _encode(tok, _string_field(record, src.text_field, "text_field"), record)
        mask = [1] * len(ids)
    else:
        prompt = _encode(tok, _string_field(record, src.prompt_field, "prompt_field"), record)
        completion = _encode(tok, _string_field(record, src.completion_field, "completion_field"), record)
        ids = prompt + completion
        mask = [0 if src.completion_only else 1] * len(prompt) + [1] * len(completion)
    if add_bos and tok.bos_id is not None:
        ids, mask = [tok.bos_id, *ids], [0, *mask]
    if append_eos:
        ids, mask = [*ids, tok.eos_id], [*mask, 1]
    if pad_to and ids and len(ids) % pad_to:
        extra = pad_to - len(ids) % pad_to
        ids, mask = ids + [tok.eos_id] * extra, mask + [1] * extra
    return Document(ids=ids, loss_mask=mask)
