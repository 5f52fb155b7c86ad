"""Held out or not: which eval examples appear verbatim in a run's training data.

An example is found when the artifact's token stream holds its prompt followed by its answer, tokenized
the two ways a training record can hold them: prompt and answer apart (a prompt/completion record) or
as one text (a text record), as a whole: the tokens around the occurrence do not continue a word or a
number into it ("1 + 0 = 1" inside "11 + 0 = 11" is not an occurrence). The search runs over the
memory-mapped token file (no copy), aligned to whole tokens. `dllm eval tasks --run` calls a score held
out only when nothing is found.

Shapes: none (token ids as lists; the artifact as raw bytes).
"""

from __future__ import annotations

import mmap
from collections.abc import Sequence

import numpy as np

from dllm.data.artifact import Artifact
from dllm.evaluation.tasks import Example
from dllm.tokenization import Tokenizer


def found_in_artifact(
    art: Artifact, tok: Tokenizer, examples: Sequence[Example], question_only: bool = False
) -> list[bool]:
    """Per example, whether its prompt + answer appears in the artifact's tokens; `question_only`: whether its
    prompt does (a chat task's training records hold a model's own words after the question, not the reference)."""
    tokens = art.array("tokens")
    if tokens.size == 0:
        return [False] * len(examples)
    with open(tokens.filename, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return [any(_find(data, tokens, form, tok) for form in _forms(tok, ex, question_only)) for ex in examples]


def _forms(tok: Tokenizer, ex: Example, question_only: bool) -> list[list[int]]:
    """The token ids a training record holding the example would contain: prompt and answer apart, as one
    text, and as one text after a space (inside a sentence, where a BPE merges the space into a token);
    the prompt alone, and after a space or a newline (a user turn in a chat template), for `question_only`."""
    if question_only:
        forms = [tok.encode(ex.prompt), tok.encode(" " + ex.prompt.lstrip()), tok.encode("\n" + ex.prompt)[1:]]
        return [f for i, f in enumerate(forms) if f and f not in forms[:i]]
    forms = [tok.encode(ex.prompt) + tok.encode(ex.answer), tok.encode(ex.prompt + ex.answer)]
    forms.append(tok.encode(" " + ex.prompt.lstrip() + ex.answer))
    return [f for i, f in enumerate(forms) if f not in forms[:i]]


def _find(data: mmap.mmap, tokens: np.ndarray, ids: list[int], tok: Tokenizer) -> bool:
    """Whether `ids` occur as a whole in `data` (the bytes of `tokens`) at a whole-token offset."""
    dtype = tokens.dtype
    if not ids or max(ids) > np.iinfo(dtype).max or min(ids) < 0:
        return False  # not representable: cannot be in the file
    needle, size = np.asarray(ids, dtype=dtype).tobytes(), dtype.itemsize
    text = tok.decode(ids)
    opens, closes = text[:1].isalnum(), text[-1:].isalnum()  # a letter or digit at an edge could run on
    at = data.find(needle)
    while at >= 0:
        first = at // size
        whole = not (opens and _runs_on(tok, tokens, first - 1, before=True)) and not (
            closes and _runs_on(tok, tokens, first + len(ids), before=False)
        )
        if at % size == 0 and whole:
            return True
        at = data.find(needle, at + 1)
    return False


def _runs_on(tok: Tokenizer, tokens: np.ndarray, index: int, before: bool) -> bool:
    """Whether the token at `index` (just before an occurrence, or just after it) touches it with a letter or
    digit; no token there, or a special one, does not."""
    if not 0 <= index < tokens.size:
        return False
    text = tok.decode([int(tokens[index])])
    return bool(text) and (text[-1] if before else text[0]).isalnum()
