"""The OpenAI request shapes the server accepts, and the one way a request becomes a SamplerConfig.

A request body is parsed here (never by FastAPI's own validation) so that every mistake comes back as
an OpenAI error object naming the field: `ApiError(status, message, param, code)`. The diffusion
settings (policy, steps, block length, threshold, cache, guidance, ...) are extra fields of the body,
validated by the SamplerConfig schema on top of the server's defaults and resolved against the
model's decode profile exactly as `dllm generate` resolves its flags.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from dllm.config.profile import DecodeProfile
from dllm.config.sampler import SamplerConfig, resolve_sampler
from dllm.errors import UserError

# SamplerConfig fields a request may set by name; the rest come from OpenAI fields (max_tokens ->
# gen_length, temperature, top_p, stop -> stop_strings, seed) or belong to the server (compile,
# attention and shift, which the decode profile fixes).
DIFFUSION_FIELDS = (
    "policy", "steps", "block_length", "sub_block_length", "threshold", "factor", "cache", "refresh_every",
    "cfg_scale", "top_k", "stop_at_eos", "reuse_unchanged",
)  # fmt: skip
# OpenAI fields a client may send that change nothing here (accepted so that stock clients work).
IGNORED_FIELDS = (
    "user", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "presence_penalty", "frequency_penalty",
    "logit_bias", "stream_options", "response_format", "tools", "tool_choice", "parallel_tool_calls",
    "metadata", "store", "service_tier",
)  # fmt: skip
# Not served yet: a request naming them is refused with a clear message.
REFUSED_FIELDS = {
    "draft_model": "speculative decoding is not served yet",
    "speculative": "speculative decoding is not served yet",
    "edits": "edit-flow decoding is not served yet",
}


class ApiError(Exception):
    """An OpenAI-shaped error: HTTP status, one-line message, the offending field and a code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=False, allow_inf_nan=False)

    model: str | None = None
    """The served model's id (GET /v1/models); null: the one model this server holds."""
    max_tokens: int | None = Field(default=None, gt=0)
    """Tokens to generate (the canvas length); null: the server's gen_length."""
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    """Seed of a stochastic request (temperature > 0 or a random-order policy): it then runs in its own
    batch with its own generator, so the same seed gives the same text whatever else is queued."""
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text (content parts of type text, joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(str(p.get("text", "")) for p in self.content if p.get("type") == "text")


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)


def parse_body(raw: bytes, cls: type[_Request]) -> _Request:
    """The request from its JSON body; malformed JSON, a wrong type or an unknown field -> 400 naming it."""
    try:
        data = json.loads(raw or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name, why in REFUSED_FIELDS.items():
        if name in data:
            raise ApiError(400, f"{name}: {why}", param=name, code="unsupported")
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = _field_path(err["loc"])
        raise ApiError(400, f"{param}: {err['msg']}", param=param, code="invalid_value") from None
    known = set(DIFFUSION_FIELDS) | set(IGNORED_FIELDS) | {"denoise"}
    for name in req.model_extra or {}:
        if name not in known:
            raise ApiError(400, f"{name}: unknown field (diffusion fields: {', '.join(DIFFUSION_FIELDS)})",
                           param=name, code="unknown_field")  # fmt: skip
    return req


@dataclass(frozen=True)
class Settings:
    """What the engine needs of one request besides its prompts."""

    cfg: SamplerConfig
    """The resolved sampler (its gen_length may round max_tokens up to whole blocks)."""
    max_tokens: int
    """Tokens returned per choice (cut from a canvas of cfg.gen_length)."""
    seed: int | None
    stochastic: bool
    """The policy or the temperature draws random numbers (see _Request.seed for how seeds batch)."""


# Policies that draw random numbers even at temperature 0 (random orders, the reverse processes).
RANDOM_POLICIES = frozenset({"random", "ancestral", "first_hitting", "uniform"})


def sampler_settings(req: _Request, base: SamplerConfig, profile: DecodeProfile) -> Settings:
    """The request's SamplerConfig: the server's defaults < the request's fields, resolved against the
    model's decode profile. A value the schema refuses -> 400 naming the field."""
    values = base.model_dump()
    extra = {k: _field_value(k, v) for k, v in (req.model_extra or {}).items() if k in DIFFUSION_FIELDS}
    values.update(extra)
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens or base.gen_length
    for name, v in (("temperature", req.temperature), ("top_p", req.top_p), ("seed", req.seed)):
        if v is not None:
            values[name] = v
    if req.stop is not None:  # else the server's own stop strings
        values["stop_strings"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if max_tokens >= profile.max_length:
        raise ApiError(400, f"max_tokens: {max_tokens} leaves no room for a prompt in the model's "
                       f"{profile.max_length} positions; lower it", param="max_tokens",
                       code="context_length_exceeded")  # fmt: skip
    block = values.get("block_length") or (profile.block_size if profile.attention == "block" else None)
    gen_length = -(-max_tokens // block) * block if block else max_tokens  # whole blocks
    values["gen_length"] = gen_length
    if "steps" not in extra:  # the server's steps per token, in whole steps per block
        num_blocks = gen_length // block if block else 1
        per_block = max(round(gen_length * base.total_steps / base.gen_length / num_blocks), 1)
        values["steps"] = per_block * num_blocks
    try:
        cfg = resolve_sampler(SamplerConfig.model_validate(values), profile)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(x) for x in err["loc"]) or _guess_param(err["msg"])
        raise ApiError(400, f"{param}: {str(err['msg']).removeprefix('Value error, ')}", param=param,
                       code="invalid_value") from None  # fmt: skip
    except UserError as e:
        msg = str(e).removeprefix("sampler.")
        raise ApiError(400, msg, param=msg.split(":")[0] if ":" in msg else None, code="invalid_value") from None
    stochastic = cfg.temperature > 0 or cfg.policy in RANDOM_POLICIES
    return Settings(cfg, max_tokens, req.seed, stochastic)


def _field_value(name: str, value: Any) -> Any:
    """One diffusion field checked against its SamplerConfig declaration before it sizes the canvas."""
    info = SamplerConfig.model_fields[name]
    try:
        return TypeAdapter(Annotated[info.annotation, info]).validate_python(value)
    except ValidationError as e:
        raise ApiError(400, f"{name}: {e.errors()[0]['msg']}", param=name, code="invalid_value") from None


def _guess_param(msg: str) -> str | None:
    """The field a cross-field rule of SamplerConfig names first (its messages start with it)."""
    first = str(msg).removeprefix("Value error, ").split(" ")[0]
    return first if first in SamplerConfig.model_fields else None


def _field_path(loc: tuple) -> str | None:
    """`messages.0.role` from pydantic's location, without the names of union members (`prompt.str`)."""
    parts = [str(x) for x in loc if isinstance(x, int) or (str(x).isidentifier() and str(x) not in _TYPE_NAMES)]
    return ".".join(parts) or None


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
