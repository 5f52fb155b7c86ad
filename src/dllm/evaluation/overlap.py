"""Held out or not: which eval examples appear verbatim in a run's training data.

An example is found when the artifact's token stream holds its prompt followed by its answer, whatever the
whitespace between them (a training record may write " 7" where the task writes "7", or a newline): the
prompt's tokens, then only whitespace tokens, then the answer's tokens (each stripped of its surrounding
whitespace, and each also encoded after a space, where a BPE merges the space into its first token); or
the two tokenized as one text (a text record, whose tokens may merge across the boundary). Either as a
whole: the tokens around the occurrence do not continue a word or a number into it ("1 + 0 = 1" inside
"11 + 0 = 11" is not an occurrence). The search runs over the memory-mapped token file (no copy), aligned
to whole tokens. `dllm eval tasks --run` calls a score held out only when nothing is found.

Shapes: none (token ids as lists; the artifact as raw bytes).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator, Sequence

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
        return [
            any(_find(data, tokens, form, tok) for form in _forms(tok, ex, question_only))
            or (not question_only and _found_apart(data, tokens, tok, ex))
            for ex in examples
        ]


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


MAX_SPACE_TOKENS = 8
"""The most whitespace tokens `_found_apart` steps over between a prompt and its answer."""


def _found_apart(data: mmap.mmap, tokens: np.ndarray, tok: Tokenizer, ex: Example) -> bool:
    """Whether the example's prompt occurs (whole at its start), followed by whitespace tokens only, then by its
    answer (whole at its end): prompt and answer tokenized apart, so any spacing between them matches."""
    prompt, answer = ex.prompt.strip(), ex.answer.strip()
    if not prompt or not answer:
        return False
    prompts = _distinct([tok.encode(prompt), tok.encode(" " + prompt)])
    answers = _distinct([tok.encode(answer), tok.encode(" " + answer)])
    closes = answer[-1].isalnum()
    for ids in prompts:
        for first in _occurrences(data, tokens, ids, tok, check_end=False):
            at = _after_space(tok, tokens, first + len(ids))
            if any(_answer_at(tok, tokens, at, a, closes) for a in answers):
                return True
    return False


def _answer_at(tok: Tokenizer, tokens: np.ndarray, at: int, ids: list[int], closes: bool) -> bool:
    """Whether `ids` are the tokens at `at`, whole at their end (`closes`: the answer ends in a letter or digit)."""
    end = at + len(ids)
    if end > tokens.size or not np.array_equal(tokens[at:end], ids):
        return False
    return not (closes and _runs_on(tok, tokens, end, before=False))


def _distinct(forms: list[list[int]]) -> list[list[int]]:
    return [f for i, f in enumerate(forms) if f and f not in forms[:i]]


def _after_space(tok: Tokenizer, tokens: np.ndarray, index: int) -> int:
    """The first index at or after `index` whose token is not whitespace (at most MAX_SPACE_TOKENS skipped)."""
    for _ in range(MAX_SPACE_TOKENS):
        if index >= tokens.size:
            break
        text = tok.decode([int(tokens[index])])
        if not text or text.strip():
            break
        index += 1
    return index


def _find(data: mmap.mmap, tokens: np.ndarray, ids: list[int], tok: Tokenizer) -> bool:
    """Whether `ids` occur as a whole in `data` (the bytes of `tokens`) at a whole-token offset."""
    return next(_occurrences(data, tokens, ids, tok), None) is not None


def _occurrences(
    data: mmap.mmap, tokens: np.ndarray, ids: list[int], tok: Tokenizer, check_end: bool = True
) -> Iterator[int]:
    """The token indices where `ids` occur in `data` (the bytes of `tokens`) at a whole-token offset, whole at
    their start (and, `check_end`, at their end)."""
    dtype = tokens.dtype
    if not ids or max(ids) > np.iinfo(dtype).max or min(ids) < 0:
        return  # not representable: cannot be in the file
    needle, size = np.asarray(ids, dtype=dtype).tobytes(), dtype.itemsize
    text = tok.decode(ids)
    opens, closes = text[:1].isalnum(), check_end and text[-1:].isalnum()  # a letter or digit at an edge runs on
    at = data.find(needle)
    while at >= 0:
        first = at // size
        whole = not (opens and _runs_on(tok, tokens, first - 1, before=True)) and not (
            closes and _runs_on(tok, tokens, first + len(ids), before=False)
        )
        if at % size == 0 and whole:
            yield first
        at = data.find(needle, at + 1)


def _runs_on(tok: Tokenizer, tokens: np.ndarray, index: int, before: bool) -> bool:
    """Whether the token at `index` (just before an occurrence, or just after it) touches it with a letter or
    digit; no token there, or a special one, does not."""
    if not 0 <= index < tokens.size:
        return False
    text = tok.decode([int(tokens[index])])
    return bool(text) and (text[-1] if before else text[0]).isalnum()
