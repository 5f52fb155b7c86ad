"""Held out or not: which eval examples appear verbatim in a run's training data.

An example is found when the artifact's token stream holds its prompt followed by its answer, tokenized
the two ways a training record can hold them: prompt and answer apart (a prompt/completion record) or
as one text (a text record). The search runs over the memory-mapped token file (no copy), aligned to
whole tokens. `dllm eval tasks --run` calls a score held out only when nothing is found.

Shapes: none (token ids as lists; the artifact as raw bytes).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from dllm.data.artifact import Artifact
from dllm.evaluation.tasks import Example
from dllm.tokenization import Tokenizer


def found_in_artifact(art: Artifact, tok: Tokenizer, examples: Sequence[Example]) -> list[bool]:
    """Per example, whether its prompt + answer appears in the artifact's tokens."""
    tokens = art.array("tokens")
    if tokens.size == 0:
        return [False] * len(examples)
    with open(tokens.filename, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return [any(_find(data, form, tokens.dtype) for form in _forms(tok, ex)) for ex in examples]


def _forms(tok: Tokenizer, ex: Example) -> list[list[int]]:
    """The token ids a training record holding the example would contain."""
    apart = tok.encode(ex.prompt) + tok.encode(ex.answer)
    joined = tok.encode(ex.prompt + ex.answer)
    return [apart] if apart == joined else [apart, joined]


def _find(data: mmap.mmap, ids: list[int], dtype: np.dtype) -> bool:
    """Whether `ids` occur in `data` (little-endian `dtype` values) at a whole-token offset."""
    if not ids or max(ids) > np.iinfo(dtype).max or min(ids) < 0:
        return False  # not representable: cannot be in the file
    needle, size = np.asarray(ids, dtype=dtype).tobytes(), dtype.itemsize
    at = data.find(needle)
    while at >= 0 and at % size:
        at = data.find(needle, at + 1)
    return at >= 0
