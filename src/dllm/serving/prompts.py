"""A request's prompts as token ids, and their checks against the model and the server's limits.

Tokenizing a long prompt takes a while: the app calls these from a worker thread, never on the event
loop, so that /health and the streams of other requests go on answering meanwhile.
"""

from __future__ import annotations

from dllm.config.profile import DecodeProfile
from dllm.serving.errors import ApiError
from dllm.serving.limits import Limits
from dllm.serving.protocol import MAX_ROWS, ChatMessage, ChatRequest, CompletionRequest, Settings
from dllm.tokenization import Tokenizer


def completion_prompts(tokenizer: Tokenizer, req: CompletionRequest) -> list[list[int]]:
    """The prompts of a completion request: a string, token ids, or a list of either (a batch)."""
    p = req.prompt
    batch = [p] if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else list(p)
    if not batch:
        raise ApiError(400, "prompt: give at least one prompt", param="prompt", code="invalid_value")
    check_rows(len(batch), req.n)  # before tokenizing what would be refused anyway
    return [tokenizer.encode(x) if isinstance(x, str) else list(x) for x in batch]  # type: ignore[arg-type]


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
        which = f"{field} {i}" if len(prompts) > 1 else field
        if any(not 0 <= t < profile.num_tokens for t in ids):
            raise ApiError(400, f"{which}: token ids must lie in [0, {profile.num_tokens})", param=field)
        if profile.shift and not ids:
            raise ApiError(400, f"{which}: this model predicts each token from the one before; give a non-empty "
                           "prompt", param=field)  # fmt: skip
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(400, f"{which}: {len(ids)} tokens, past the limit of {limits.max_prompt_tokens} prompt "
                           f"tokens (the model has {positions} positions); shorten it", param=field,
                           code="context_length_exceeded")  # fmt: skip
        if len(ids) + g > positions:
            length = req.max_tokens_field()
            blame = length or field
            raise ApiError(400, f"{blame}: the prompt's {len(ids)} tokens plus {g} to generate pass the model's "
                           f"{positions} positions; shorten the prompt or lower {length or 'max_tokens'}",
                           param=blame, code="context_length_exceeded")  # fmt: skip
