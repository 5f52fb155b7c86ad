"""What one request may ask for, fixed when the server starts (`dllm serve` flags), and the defaults.

No third-party import here: the command line reads the defaults for its help without the serve extra.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
"""The largest request body by default: a prompt filling a long context, with room."""


@dataclass(frozen=True)
class Limits:
    """What one request may ask for, fixed when the server starts (`dllm serve` flags)."""

    max_body_bytes: int
    """The largest request body (--max-body-bytes), refused with 413 before it is parsed."""
    max_prompt_tokens: int
    """The longest prompt in tokens (--max-prompt-tokens; at most the model's positions less one)."""
    max_steps: int
    """The largest step budget of one request (--max-steps): every step is a forward of the model."""
    max_prompt_chars: int
    """The longest prompt text in characters: max_prompt_tokens x the most characters a token of the model's
    tokenizer stands for (tokenization.max_chars_per_token). Longer text cannot fit and is refused before it is
    tokenized (tokenizing megabytes to refuse them cost seconds and memory that never came back)."""
