"""Stop strings: end a row early once its decided text contains one, and cut the text before it.

Shared by the CLI (`dllm generate`, `dllm chat`, `dllm eval`) and the lm-evaluation-harness adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def stop_function(tokenizer: Any, stop_strings: list[str]) -> Callable[[list[int]], bool] | None:
    """A row has ended once its decided text contains a stop string."""
    if not stop_strings:
        return None
    return lambda ids: any(s in tokenizer.decode(ids) for s in stop_strings)


def cut_at_stop(text: str, stop_strings: list[str]) -> str:
    """The text before the first stop string (the stop string itself is not returned)."""
    cut = min((i for i in (text.find(s) for s in stop_strings) if i >= 0), default=len(text))
    return text[:cut]
