"""The OpenAI request shapes the server accepts, and the one way a request becomes a SamplerConfig.

A request body is parsed here (never by FastAPI's own validation) so that every mistake comes back as
an OpenAI error object naming the field: `ApiError(status, message, param, code)`. Types are strict, as
OpenAI's reference gives them ("8" is not an integer, true is not a number, "yes" is not a boolean);
ranges are OpenAI's (temperature in [0, 2], top_p in (0, 1], n in [1, MAX_N], at most 4 stop strings);
fields the server does not honour are refused (serving/unserved.py), unknown ones too. The diffusion
settings (policy, steps, block length, threshold, cache, guidance, ...) are extra fields of the body,
validated by the SamplerConfig schema on top of the server's defaults and resolved against the
model's decode profile exactly as `dllm generate` resolves its flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from dllm.config.base import MAX_SEED
from dllm.config.profile import DecodeProfile
from dllm.config.sampler import DENOISE_FIELDS, HOW, READS, SamplerConfig, resolve_sampler
from dllm.errors import UserError
from dllm.serving.errors import ApiError
from dllm.serving.unserved import LOGPROB_FIELDS, MESSAGE_FIELDS, REQUEST_FIELDS, SPECULATIVE_FIELDS, refuse_unserved

# SamplerConfig fields a request may set by name; the rest come from OpenAI fields (max_tokens ->
# gen_length, temperature, top_p, stop -> stop_strings, seed) or belong to the server (compile,
# attention and shift, which the decode profile fixes).
DIFFUSION_FIELDS = (
    "policy", "steps", "block_length", "sub_block_length", "threshold", "factor", "cache", "refresh_every",
    "cfg_scale", "top_k", "stop_at_eos", "reuse_unchanged", "edit_threshold", "max_post_steps", "min_commit",
    *DENOISE_FIELDS,
)  # fmt: skip


def request_fields(generation: str) -> tuple[str, ...]:
    """The extra (non-OpenAI) fields a server whose sampler's generation is `generation` reads (config.sampler.READS:
    the rule `resolve_sampler` applies everywhere); the model card of GET /v1/models lists them, so that a client
    (the page) sends only those."""
    return tuple(name for name in DIFFUSION_FIELDS if name in READS[generation])


MAX_N = 16
"""Choices per prompt (OpenAI documents none): n in [1, 16]."""
MAX_ROWS = 256
"""Rows (prompts x n) one request may ask for."""
MAX_STOP = 4
"""Stop strings per request, as OpenAI allows."""
MAX_LOGPROBS, MAX_TOP_LOGPROBS = 5, 20
"""The most likely tokens a completion (logprobs) or a chat completion (top_logprobs) may ask for, as OpenAI."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """A last chunk with no choices and the usage of the whole request."""


class _Request(BaseModel):
    # strict: JSON types as OpenAI's reference gives them ("8" is no integer, true is no number)
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str | None = None
    """The served model's id (GET /v1/models); null: the one model this server holds."""
    max_tokens: int | None = Field(default=None, ge=0)
    """Tokens to generate (the canvas length); null: the server's gen_length; 0 only with echo (scoring)."""
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    """Seed of a stochastic request (temperature > 0, a random-order policy, DiffusionGemma): it then runs in its own
    batch with its own generator, so the same seed gives the same text whatever else is queued."""
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    """The end user's id: metadata by OpenAI's definition (abuse monitoring); nothing here reads or keeps it."""
    denoise: bool = False
    """With stream: the canvas after every step rides the stream beside the text (as on /v1/denoise)."""
    speculative: bool | None = None
    """A server with a drafter (dllm serve --draft): false decodes this request without it (AR decoding)."""

    def max_tokens_field(self) -> str | None:
        """The field that set the length to generate, if the request set it."""
        return "max_tokens" if self.max_tokens is not None else None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """Causal models: the log-probability of each returned token and the `logprobs` most likely at its place."""
    echo: bool = False
    """Causal models: the prompt comes back before the completion, its tokens scored too (with max_tokens 0:
    scoring only, as lm-eval's log-likelihood requests do)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = Field(default=None, validate_default=True)
    """A string or a list of text parts; null (or left out) only in an assistant turn, as OpenAI allows (its
    answer to a tool call has none), and read as no text."""

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content: Any, info: ValidationInfo) -> Any:
        """Text parts only: an image or audio part would be dropped from the prompt without a word."""
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs its content: a string or a list of text parts (null only in "
                             "an assistant message)")  # fmt: skip
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("give a string or a list of text parts")
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i} is {kind!r}: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                 "are served")  # fmt: skip
            if not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
                raise ValueError(f"part {i}: a text part holds exactly type and text (a string)")
        return content

    def text(self) -> str:
        """The message's text (its text parts, joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p["text"] for p in self.content)


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, gt=0)
    logprobs: bool = False
    """Causal models: the log-probability of each returned token."""
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    """With logprobs: the most likely tokens at each place, and theirs."""

    def max_tokens_field(self) -> str | None:
        return "max_completion_tokens" if self.max_completion_tokens is not None else super().max_tokens_field()


def parse_request(
    data: dict[str, Any], kind: str, causal: bool = False, drafting: bool = False
) -> CompletionRequest | ChatRequest:
    """The request of endpoint `kind` (completion, chat or denoise) from its JSON object. A wrong type or
    range, an unknown field, or a field this server does not honour -> 400 naming it. Null in a top-level
    field means what leaving it out means: the server's default. A `causal` model's server honours the
    log-probability fields (logprobs, top_logprobs, echo) on completions and chat completions; a server
    with a drafter (`drafting`) honours `speculative`."""
    data = {k: v for k, v in data.items() if v is not None}
    chat = kind == "chat" or (kind == "denoise" and "messages" in data)
    scored = causal and kind != "denoise"
    honoured = {*(LOGPROB_FIELDS if scored else ()), *(SPECULATIVE_FIELDS if drafting else ())}
    data = refuse_unserved(data, {k: v for k, v in REQUEST_FIELDS.items() if k not in honoured})
    if chat:
        data = _refuse_unserved_in_messages(data)
    cls = ChatRequest if chat else CompletionRequest
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        raise invalid(e) from None
    for name in req.model_extra or {}:
        if name not in DIFFUSION_FIELDS:
            raise ApiError(400, f"{name}: unknown field (diffusion fields: {', '.join(DIFFUSION_FIELDS)})",
                           param=name, code="unknown_field")  # fmt: skip
    _check_combinations(req, kind)
    return req


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or a conversation rendered by the chat template."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    """With messages: end with the header of the assistant's turn, as a chat completion does."""
    add_special_tokens: Literal[False] = False
    """Prompts are never given special tokens (a BOS) here: false is what the server does, true is refused."""


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape): token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int]


def parse_tokenize(data: dict[str, Any]) -> TokenizeRequest:
    try:
        req = TokenizeRequest.model_validate(_refuse_unserved_in_messages(data))
    except ValidationError as e:
        raise invalid(e) from None
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "prompt: give a prompt or messages (one of them)", param="prompt", code="invalid_value")
    if req.messages is None and "add_generation_prompt" in req.model_fields_set:
        raise ApiError(400, "add_generation_prompt: only with messages", param="add_generation_prompt",
                       code="invalid_value")  # fmt: skip
    return req


def parse_detokenize(data: dict[str, Any]) -> DetokenizeRequest:
    try:
        return DetokenizeRequest.model_validate(data)
    except ValidationError as e:
        raise invalid(e) from None


def _refuse_unserved_in_messages(data: dict[str, Any]) -> dict[str, Any]:
    messages = data.get("messages")
    if not isinstance(messages, list):
        return data
    messages = [refuse_unserved(m, MESSAGE_FIELDS, f"messages.{i}.") if isinstance(m, dict) else m
                for i, m in enumerate(messages)]  # fmt: skip
    return {**data, "messages": messages}


def _check_combinations(req: CompletionRequest | ChatRequest, kind: str) -> None:
    """Rules between fields, each a 400 naming the field that would otherwise do nothing."""

    def refuse(param: str, message: str) -> None:
        raise ApiError(400, f"{param}: {message}", param=param, code="invalid_value")

    given = req.model_fields_set
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        refuse("stop", f"give at most {MAX_STOP} stop strings (got {len(req.stop)})")
    if req.stop == "" or (isinstance(req.stop, list) and "" in req.stop):
        refuse("stop", "an empty stop string would end every completion before it starts")
    if (
        isinstance(req, ChatRequest)
        and {"max_tokens", "max_completion_tokens"} <= given
        and (req.max_tokens != req.max_completion_tokens)
    ):
        refuse("max_tokens", "give max_completion_tokens or max_tokens, not two different lengths")
    if kind == "denoise":
        for name in ("stream", "denoise"):
            if name in given and not getattr(req, name):
                refuse(name, "/v1/denoise always streams the canvas after every step")
        if "stream_options" in given:
            refuse("stream_options", "the /v1/denoise stream always ends with the usage")
        return
    if "stream_options" in given and not req.stream:
        refuse("stream_options", "only with stream: true")
    scoring = (req.logprobs is not None or req.echo) if isinstance(req, CompletionRequest) else req.logprobs
    if scoring and req.stream:
        refuse("logprobs" if "logprobs" in given else "echo", "log-probabilities come with whole answers only; "
               "drop stream")  # fmt: skip
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        refuse("top_logprobs", "only with logprobs: true")
    if req.max_tokens == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        refuse("max_tokens", "0 generates nothing; give at least 1 (0 only with echo, to score the prompt)")
    if req.denoise and not req.stream:
        refuse("denoise", "the denoising frames ride a stream: send stream: true too, or POST /v1/denoise")


def invalid(e: ValidationError) -> ApiError:
    """A pydantic error as a 400 naming the field (its first error; messages without pydantic's prefix)."""
    err = e.errors()[0]
    param = _field_path(err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    if err["loc"][:1] == ("prompt",) and err["type"] != "missing":
        param, msg = "prompt", "give a string, a list of strings, a list of token ids or a list of lists of them"
    return ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


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
    draft: bool = True
    """With the server's drafter (a causal model served with --draft); False: AR decoding."""


# Policies that draw random numbers even at temperature 0 (random orders, the reverse processes).
RANDOM_POLICIES = frozenset({"random", "ancestral", "first_hitting", "uniform"})


def sampler_settings(req: _Request, base: SamplerConfig, profile: DecodeProfile, max_steps: int) -> Settings:
    """The request's SamplerConfig: the server's defaults < the request's fields, resolved against the
    model's decode profile. A value the schema refuses, or past the model's positions or `max_steps`
    -> 400 naming the field."""
    values = base.model_dump()
    extra = {k: _field_value(k, v) for k, v in (req.model_extra or {}).items() if k in DIFFUSION_FIELDS}
    causal = base.generation == "causal"
    fields = request_fields(base.generation)
    for name in extra:  # the rule of resolve_sampler (config.sampler.READS), with the fields that do apply
        if name not in fields:
            raise ApiError(400, f"{name}: no effect on this server's {HOW[base.generation]} (fields that apply: "
                           f"{', '.join(fields)})", param=name, code="unsupported_field")  # fmt: skip
    values.update(extra)
    length_field = req.max_tokens_field() or "max_tokens"
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    max_tokens = base.gen_length if max_tokens is None else max_tokens  # 0: echo scores the prompt only
    for name, v in (("temperature", req.temperature), ("top_p", req.top_p), ("seed", req.seed)):
        if v is not None:
            values[name] = v
    if req.stop is not None:  # else the server's own stop strings
        values["stop_strings"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if max_tokens >= profile.max_length:
        raise ApiError(400, f"{length_field}: {max_tokens} leaves no room for a prompt in the model's "
                       f"{profile.max_length} positions; lower it", param=length_field,
                       code="context_length_exceeded")  # fmt: skip
    block = values.get("block_length") or (profile.block_size if profile.attention == "block" else None)
    block = None if causal else block
    gen_length = -(-max_tokens // block) * block if block else max_tokens  # whole blocks
    values["gen_length"] = max(gen_length, 1)  # max_tokens 0 (echo): one token decoded, none returned
    if causal:  # at most one target forward per token (fewer with a drafter's accepted proposals)
        values["steps"] = None
        _check_steps(gen_length, max_steps, length_field)
    elif "steps" not in extra:  # the server's steps per token, in whole steps per block
        num_blocks = gen_length // block if block else 1
        per_block = max(round(gen_length * base.total_steps / base.gen_length / num_blocks), 1)
        values["steps"] = per_block * num_blocks
    if not causal:
        _check_steps(values["steps"] or gen_length, max_steps, "steps" if "steps" in extra else length_field)
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
    # canvas_denoise draws its canvases and their re-noising at random even with greedy proposals
    stochastic = cfg.temperature > 0 or cfg.policy in RANDOM_POLICIES or cfg.generation == "canvas_denoise"
    return Settings(cfg, max_tokens, req.seed, stochastic, draft=req.speculative is not False)


def _check_steps(steps: int, max_steps: int, field: str) -> None:
    """Every step is a forward of the model: a request asks for at most `max_steps` of them."""
    if steps <= max_steps:
        return
    how = "" if field == "steps" else f" (the server's steps per token at this {field})"
    raise ApiError(400, f"{field}: {steps} steps{how} pass the server's limit of {max_steps} "
                   "(dllm serve --max-steps); ask for fewer", param=field, code="invalid_value")  # fmt: skip


def _field_value(name: str, value: Any) -> Any:
    """One diffusion field checked against its SamplerConfig declaration before it sizes the canvas."""
    info = SamplerConfig.model_fields[name]
    try:
        return TypeAdapter(Annotated[info.annotation, info]).validate_python(value, strict=True)
    except ValidationError as e:
        msg = str(e.errors()[0]["msg"]).removeprefix("Value error, ")
        raise ApiError(400, f"{name}: {msg}", param=name, code="invalid_value") from None


def _guess_param(msg: str) -> str | None:
    """The field a cross-field rule of SamplerConfig names first (its messages start with it)."""
    first = str(msg).removeprefix("Value error, ").split(" ")[0]
    return first if first in SamplerConfig.model_fields else None


def _field_path(loc: tuple) -> str | None:
    """`messages.0.role` from pydantic's location, without the names of union members (`prompt.str`)."""
    parts = [str(x) for x in loc if isinstance(x, int) or (str(x).isidentifier() and str(x) not in _TYPE_NAMES)]
    return ".".join(parts) or None


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})
