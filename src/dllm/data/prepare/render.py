"""Render a record into token ids with its supervision mask, then fit it to the length limit.

Supervision says which tokens are trained on (and noised): the prompt of a prompt/completion
record or the non-assistant turns of a chat are context only. Chat spans come from the tokenizer's
chat template (`assistant_mask`), never from searching the rendered text.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dllm.config.prepare import RecordFields
from dllm.config.registries import RECORD_FORMATS
from dllm.data.prepare.sources import Record
from dllm.errors import DataError
from dllm.tokenization import Tokenizer


@dataclass(frozen=True)
class Document:
    """Token ids of one document and which of them are training targets."""

    ids: list[int]
    loss_mask: list[int]

    def __len__(self) -> int:
        return len(self.ids)

    def slice(self, lo: int, hi: int) -> Document:
        return Document(self.ids[lo:hi], self.loss_mask[lo:hi])


def get_field(data: dict[str, Any], dotted: str, where: str, option: str = "text_field") -> Any:
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise DataError(f"{where}: record has no field {dotted!r}; set {option} in the source config")
        node = node[part]
    return node


def text_chars(record: Record, f: RecordFields) -> int:
    """Characters in the strings the record's format renders (missing fields count 0); tokenizes nothing."""
    fields = {
        "text": [f.text_field],
        "messages": [f.messages_field],
        "prompt_completion": [f.prompt_field, f.completion_field],
    }.get(f.format, [])
    stack: list[Any] = []
    for dotted in fields:
        with contextlib.suppress(DataError):  # a missing field: render names it
            stack.append(get_field(record.data, dotted, record.where))
    total = 0
    while stack:  # iterative: a record may nest as deep as JSON allows
        node = stack.pop()
        if isinstance(node, str):
            total += len(node)
        elif isinstance(node, list | dict):
            stack.extend(node.values() if isinstance(node, dict) else node)
    return total


def _encode(tok: Tokenizer, text: str, where: str) -> list[int]:
    _check_encodable(text, where)
    return tok.encode(text)


def _check_encodable(text: str, where: str) -> None:
    """Training text is taken as it is or refused: a tokenizer would turn lone surrogates into U+FFFD."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise DataError(f"{where}: text holds characters that cannot be encoded (lone surrogates)") from None


def _string(record: Record, dotted: str, option: str) -> str:
    value = get_field(record.data, dotted, record.where, option)
    if not isinstance(value, str):
        raise DataError(f"{record.where}: field {dotted!r} is {type(value).__name__}, expected a string")
    return value


def _turns(value: Any, where: str, dotted: str) -> list[dict[str, str]]:
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )
    if not ok:
        raise DataError(f"{where}: field {dotted!r} must be a list of {{role, content}} turns")
    return value


def _chat(tok: Tokenizer, turns: list[dict[str, str]], where: str, generation_prompt: bool = False):
    for turn in turns:
        _check_encodable(turn["content"], where)
    try:
        return tok.apply_chat_template(turns, add_generation_prompt=generation_prompt)
    except ValueError as e:  # an unknown role, a template that rejects the conversation
        raise DataError(f"{where}: cannot render the chat: {e}") from None


def render_text(record: Record, f: RecordFields, tok: Tokenizer) -> Document:
    ids = _encode(tok, _string(record, f.text_field, "text_field"), record.where)
    return Document(ids, [1] * len(ids))


def render_prompt_completion(record: Record, f: RecordFields, tok: Tokenizer) -> Document:
    prompt = get_field(record.data, f.prompt_field, record.where, "prompt_field")
    completion = get_field(record.data, f.completion_field, record.where, "completion_field")
    if isinstance(prompt, str) and isinstance(completion, str):
        p_ids = _encode(tok, prompt, record.where)
        c_ids = _encode(tok, completion, record.where)
    else:  # chat turns: the prompt rendered with a generation prompt must be a prefix of the whole chat
        p_turns = _turns(prompt, record.where, f.prompt_field)
        c_turns = _turns(completion, record.where, f.completion_field)
        p_ids = _chat(tok, p_turns, record.where, generation_prompt=True).ids
        full = _chat(tok, p_turns + c_turns, record.where).ids
        if full[: len(p_ids)] != p_ids:
            raise DataError(f"{record.where}: the chat template does not render the prompt as a prefix of the chat")
        c_ids = full[len(p_ids) :]
    prompt_sup = 1 if f.resolved_supervision == "full" else 0
    return Document(p_ids + c_ids, [prompt_sup] * len(p_ids) + [1] * len(c_ids))


def render_messages(record: Record, f: RecordFields, tok: Tokenizer) -> Document:
    turns = _turns(
        get_field(record.data, f.messages_field, record.where, "messages_field"), record.where, f.messages_field
    )
    enc = _chat(tok, turns, record.where)
    if f.resolved_supervision == "full":
        return Document(enc.ids, [1] * len(enc.ids))
    if len(enc.assistant_mask) != len(enc.ids):
        raise DataError(
            f"{record.where}: the tokenizer's chat template marks no assistant spans ({{% generation %}}); "
            "use supervision full or a template with generation markers"
        )
    if not any(enc.assistant_mask):  # it would train on nothing but the EOS and padding appended to it
        raise DataError(
            f"{record.where}: the chat has no assistant turn to train on (supervision assistant_only); "
            "remove the record or set on_bad_record: skip"
        )
    return Document(enc.ids, list(enc.assistant_mask))


def render_tokens(record: Record, f: RecordFields, tok: Tokenizer) -> Document:
    ids = get_field(record.data, f.input_ids_field, record.where, "input_ids_field")
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    V = tok.vocab_size
    bad = _first_bad(ids, lambda v: 0 <= v < V)
    if bad is not None:  # JSON true/false are Python ints too, but never token ids
        raise DataError(f"{record.where}: {f.input_ids_field!r} must be a list of ids in [0, {V}){bad}")
    if not (f.labels_field or f.loss_mask_field):
        return Document(ids, [1] * len(ids))
    dotted = f.labels_field or f.loss_mask_field
    values = get_field(record.data, dotted, record.where, "labels_field" if f.labels_field else "loss_mask_field")
    values = values.tolist() if hasattr(values, "tolist") else values
    if not isinstance(values, list) or len(values) != len(ids):
        raise DataError(f"{record.where}: {dotted!r} must be a list as long as {f.input_ids_field!r}")
    if f.labels_field:
        bad = _first_bad(values, lambda v: v == -100 or 0 <= v < V)
        what, mask = f"-100 (not trained) or token ids in [0, {V})", [int(v != -100) for v in values]
    else:
        bad = _first_bad(values, lambda v: v in (0, 1), allow_bool=True)
        what, mask = "0 or 1 per token", [int(v) for v in values]
    if bad is not None:
        raise DataError(f"{record.where}: {dotted!r} must hold {what}{bad}")
    return Document(ids, mask)


def _first_bad(values: Any, ok: Callable[[int], bool], allow_bool: bool = False) -> str | None:
    """None when `values` is a list of ints (bools only if `allow_bool`) that are all `ok`; else what is wrong
    with the first bad one, ` (index I is V)`, for the message."""
    if not isinstance(values, list):
        return f" (got a {type(values).__name__})"
    for i, v in enumerate(values):
        if not (type(v) is int or (allow_bool and type(v) is bool)) or not ok(v):
            return f" (index {i} is {repr(v)[:40]})"
    return None


Renderer = Callable[[Record, RecordFields, Tokenizer], Document]
"""A record format's renderer (registered in dllm.config.registries.RECORD_FORMATS)."""


def render(record: Record, f: RecordFields, tok: Tokenizer, add_bos: bool, append_eos: bool) -> Document:
    """Token ids and loss mask of one record, with BOS (never a target) and EOS (a target)."""
    renderer: Renderer = RECORD_FORMATS.resolve(f.format)
    doc = renderer(record, f, tok)
    ids, mask = doc.ids, doc.loss_mask
    if add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
        ids, mask = [tok.bos_id, *ids], [0, *mask]
    if append_eos and (not ids or ids[-1] != tok.eos_id):  # a chat template may already end in EOS
        ids, mask = [*ids, tok.eos_id], [*mask, 1]
    return Document(ids, mask)


def fit_length(doc: Document, limit: int | None, overflow: str) -> list[Document]:
    """The pieces of a document that fit `limit` tokens: none (reject), one (truncated), or several (split)."""
    if limit is None or len(doc) <= limit:
        return [doc]
    if overflow == "reject":
        return []
    if overflow == "truncate_right":
        return [doc.slice(0, limit)]
    if overflow == "truncate_left":
        return [doc.slice(len(doc) - limit, len(doc))]
    return [doc.slice(i, i + limit) for i in range(0, len(doc), limit)]


def pad_to_multiple(doc: Document, multiple: int | None, eos_id: int) -> Document:
    """Supervised EOS up to a multiple of `multiple` (block alignment; LLaDA-style EOS fill)."""
    if not multiple or not doc.ids or len(doc) % multiple == 0:
        return doc
    extra = multiple - len(doc) % multiple
    return Document(doc.ids + [eos_id] * extra, doc.loss_mask + [1] * extra)
