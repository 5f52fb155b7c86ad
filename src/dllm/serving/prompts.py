"""A request's prompts as token ids, and their checks against the model and the server's limits.

Tokenizing a long prompt takes a while: the app calls these from a worker thread, never on the event
loop, so that /health and the streams of other requests go on answering meanwhile. Text that could not fit
the prompt limit whatever it holds (Limits.max_prompt_chars) is refused before it is tokenized.
"""

from __future__ import annotations

from dllm.config.profile import DecodeProfile
from dllm.serving.errors import ApiError
from dllm.serving.limits import Limits
from dllm.serving.protocol import MAX_ROWS, ChatMessage, ChatRequest, CompletionRequest, Settings
from dllm.tokenization import Tokenizer


def request_prompts(tokenizer: Tokenizer, req: CompletionRequest | ChatRequest, limits: Limits) -> list[list[int]]:
    """The prompts of a completion or chat request as token ids (a chat is one conversation)."""
    if isinstance(req, ChatRequest):
        check_chars(sum(len(m.text()) for m in req.messages), "messages", "messages", limits)
        return [chat_ids(tokenizer, req.messages)]
    return completion_prompts(tokenizer, req, limits)


def completion_prompts(tokenizer: Tokenizer, req: CompletionRequest, limits: Limits) -> list[list[int]]:
    """The prompts of a completion request: a string, token ids, or a list of either (a batch)."""
    p = req.prompt
    batch = [p] if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else list(p)
    if not batch:
        raise ApiError(400, "prompt: give at least one prompt", param="prompt", code="invalid_value")
    check_rows(len(batch), req.n)  # before tokenizing what would be refused anyway
    for i, x in enumerate(batch):
        if isinstance(x, str):
            check_chars(len(x), _which("prompt", i, len(batch)), "prompt", limits)
    return [tokenizer.encode(x) if isinstance(x, str) else list(x) for x in batch]  # type: ignore[arg-type]


def check_chars(chars: int, which: str, field: str, limits: Limits) -> None:
    """Text longer than any prompt within the limit, refused without tokenizing it (a 3 MB prompt took seconds
    and ~30 MB of the server's memory, never returned, to be refused for its token count)."""
    if chars > limits.max_prompt_chars:
        raise ApiError(400, f"{which}: {chars} characters, more than the {limits.max_prompt_tokens} prompt tokens the "
                       f"server takes can hold (at most {limits.max_prompt_chars} characters); shorten it",
                       param=field, code="context_length_exceeded")  # fmt: skip


def _which(field: str, i: int, num_prompts: int) -> str:
    return f"{field} {i}" if num_prompts > 1 else field


def chat_ids(tokenizer: Tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    """A conversation rendered by the model's chat template (developer turns as system turns)."""
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt).ids
    except Exception as e:  # a template that refuses the conversation (roles, order)
        raise ApiError(400, f"messages: the chat template refused them ({e})", param="messages") from None


def check_rows(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_ROWS:
        raise ApiError(400, f"n: {num_prompts} prompts x n {n} make more than {MAX_ROWS} rows; split the request",
                       param="n")  # fmt: skip


def check_prompts(prompts: list[list[int]], req: CompletionRequest | ChatRequest, settings: Settings,
                  profile: DecodeProfile, limits: Limits) -> None:  # fmt: skip
    """Token ids the model has, and lengths that fit. A prompt too long on its own is the prompt's fault
    (its count and the limit); one that only overflows with the canvas blames max_tokens when the request
    set it, else the prompt (the server's default length is not the client's doing)."""
    field = "messages" if isinstance(req, ChatRequest) else "prompt"
    g, positions = settings.cfg.gen_length, profile.max_length
    for i, ids in enumerate(prompts):
        which = _which(field, i, len(prompts))
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(400, f"{which}: {len(ids)} tokens, past the limit of {limits.max_prompt_tokens} prompt "
                           f"tokens (the model has {positions} positions); shorten it", param=field,
                           code="context_length_exceeded")  # fmt: skip
        bad = next((j for j, t in enumerate(ids) if not 0 <= t < profile.num_tokens or t == profile.mask_id), None)
        if bad is not None:
            raise ApiError(400, f"{which}: token {bad} is {ids[bad]}, not a prompt token of this model "
                           f"({prompt_ids(profile)})", param=field, code="invalid_value")  # fmt: skip
        if profile.shift and not ids:
            raise ApiError(400, f"{which}: this model predicts each token from the one before; give a non-empty "
                           "prompt", param=field, code="invalid_value")  # fmt: skip
        if len(ids) + g > positions:
            length = req.max_tokens_field()
            blame = length or field
            raise ApiError(400, f"{blame}: the prompt's {len(ids)} tokens plus {g} to generate pass the model's "
                           f"{positions} positions; shorten the prompt or lower {length or 'max_tokens'}",
                           param=blame, code="context_length_exceeded")  # fmt: skip


def prompt_ids(profile: DecodeProfile) -> str:
    """The ids a prompt may hold: the tokenizer's, but the mask token (the placeholder of a position still to
    decide: in a prompt it would be decoded over, or read as a token no text encodes to)."""
    mask, num = profile.mask_id, profile.num_tokens
    if mask == num - 1:
        return f"ids lie in [0, {mask}); {mask} is the mask token, which only the sampler writes"
    return f"ids lie in [0, {num}) except {mask}, the mask token, which only the sampler writes"
