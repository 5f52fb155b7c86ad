"""The server's one error shape: an OpenAI error object with its HTTP status, and its JSON response."""

from __future__ import annotations

import json
from typing import Any

from starlette.responses import JSONResponse


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, one-line message, the offending field and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> ErrorResponse:
        return ErrorResponse(self.body(), status_code=self.status)


class ErrorResponse(JSONResponse):
    """JSON written as ASCII: a message that quotes the client's input stays encodable whatever it holds
    (a lone surrogate in a field name cannot be written as UTF-8, and would turn a 400 into a 500)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")
