"""A request body before it is a request: its content type (JSON, in UTF-8), its size (from Content-Length,
then while it is read, before any parsing) and strict JSON (UTF-8 bytes, no NaN or Infinity, no repeated key, a
bounded depth, text that is valid Unicode). Every refusal is an `ApiError` (415, 413 or 400), never a 500."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from dllm.serving.errors import ApiError

MAX_DEPTH = 32
"""The deepest nesting of a body (the body itself is level 1; a chat text part sits at level 5)."""


HOW_TO_SEND = "(curl: --json, or -H 'Content-Type: application/json')"


def check_content_type(request: Request) -> None:
    """JSON in UTF-8 only: a body sent as a form or plain text (curl -d without a header), one that names no
    type, or JSON in another charset is refused up front, not misread."""
    ctype = request.headers.get("content-type")
    if ctype is None:
        raise ApiError(415, f"no Content-Type: send the body as JSON, Content-Type: application/json {HOW_TO_SEND}",
                       code="unsupported_media_type")  # fmt: skip
    media, *params = (part.strip().lower() for part in ctype.split(";"))
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"Content-Type {media or ctype!r}: the body must be JSON sent as application/json "
                       f"{HOW_TO_SEND}", code="unsupported_media_type")  # fmt: skip
    charset = next((p.partition("=")[2].strip("\"' ") for p in params if p.startswith("charset=")), "utf-8")
    if charset not in ("utf-8", "utf8"):
        raise ApiError(415, f"Content-Type charset {charset!r}: JSON is read as UTF-8 only; send UTF-8 and name "
                       "charset=utf-8 or none", code="unsupported_media_type")  # fmt: skip


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `max_bytes`: from its Content-Length
    before a byte is read, else while it streams in (chunked uploads declare no length)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not (declared.isascii() and declared.isdigit()):
            raise ApiError(400, f"Content-Length {declared!r}: not a number of bytes", code="invalid_request")
        if int(declared) > max_bytes:
            raise _too_large(f"{int(declared)} bytes, more", max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large("more", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: str, max_bytes: int) -> ApiError:
    """413: `size` is 'N bytes, more' (from Content-Length) or 'more' (counted while it streamed in)."""
    return ApiError(413, f"the request body is {size} than the server's limit of {max_bytes} bytes "
                    "(dllm serve --max-body-bytes); send a shorter prompt", code="request_too_large")  # fmt: skip


def load_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object in UTF-8 (a byte-order mark is dropped); anything else is a 400 that says what
    is wrong and where. (json.loads would read UTF-16 and UTF-32 bytes too: RFC 8259 allows only UTF-8.)"""
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 (byte {e.start} is 0x{raw[e.start]:02x}); send JSON "
                       "encoded as UTF-8", code="invalid_json") from None  # fmt: skip
    if "\0" in text:  # never in JSON (escaped as \u0000 in a string): UTF-16 or UTF-32 of ASCII text
        raise ApiError(400, f"the request body is not UTF-8 (byte {raw.index(0)} is 0x00, as in UTF-16 or UTF-32); "
                       "send JSON encoded as UTF-8", code="invalid_json")  # fmt: skip
    try:
        data = json.loads(text or "null", parse_constant=_no_constant, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ApiError(400, f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except ValueError as e:  # json's errors are ValueErrors
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    _check_tree(data)
    return data


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number or null")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) < len(pairs):  # one of two values would be dropped without a word
        seen: set[str] = set()
        repeated = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"the key {repeated!r} appears twice in one object")
    return out


def _check_tree(data: dict[str, Any]) -> None:
    """Depth and text of every value, without recursion (the walk is as deep as the body)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"{path}: the body nests deeper than {MAX_DEPTH} levels", param=path,
                           code="invalid_json")  # fmt: skip
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str):
                _check_text(key, where)
            if isinstance(value, str):
                _check_text(value, where)
            elif isinstance(value, (dict, list)):
                stack.append((value, where, depth + 1))


def _check_text(text: str, where: str) -> None:
    """A lone surrogate (JSON's "\\ud800" escape without its pair) decodes to a str that is no text: no
    tokenizer can encode it. Refused here, naming the field, before anything tries."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{where}: a lone surrogate (\\u{ord(text[e.start]):04x} at character {e.start}) is not "
                       "text; send UTF-8, or escape a character outside the BMP as a surrogate pair", param=where,
                       code="invalid_text") from None  # fmt: skip
