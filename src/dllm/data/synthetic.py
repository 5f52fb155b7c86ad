"""Generated text with checkable content: the demo corpus written by `dllm init`.

Arithmetic facts ("23 + 45 = 68") give answers that can be counted right or wrong; templated
sentences give the model some English to learn. Everything is a pure function of the seed.

Held out by construction: the sums of the built-in `addition` task's eval split (`held_out_sums`: the
154 distinct sums among the first 200 draws of its seed-0 generator, operands 0..19) are never emitted
by a generator of training data here (`training_sum`), nor by the recipes' and `dllm init`'s, which
build on it; evaluation/tasks.py scores `addition` on them only.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator

SUBJECTS = [
    "the cat",
    "a dog",
    "the old man",
    "my sister",
    "the teacher",
    "a small bird",
    "the farmer",
    "our team",
]
VERBS = ["sees", "likes", "finds", "paints", "carries", "follows", "builds", "cleans"]
OBJECTS = [
    "a red ball",
    "the green door",
    "an apple",
    "the long road",
    "a wooden box",
    "the blue sky",
    "a map",
]
PLACES = [
    "in the park",
    "at home",
    "near the river",
    "on monday",
    "after lunch",
    "in the morning",
    "by the sea",
]


EVAL_SUM_MAX_OPERAND = 19
EVAL_SUM_DRAWS = 200
EVAL_SUM_SEED = "addition:0"
"""The eval split of sums: every sum among the first EVAL_SUM_DRAWS draws of random.Random(EVAL_SUM_SEED)
with operands 0..EVAL_SUM_MAX_OPERAND (the draws `dllm eval tasks --tasks addition` has always scored)."""


def random_sum(rng: random.Random, max_operand: int) -> tuple[int, int]:
    """Two operands 0..max_operand (the addition task's draw)."""
    return rng.randint(0, max_operand), rng.randint(0, max_operand)


@functools.cache
def held_out_sums() -> frozenset[tuple[int, int]]:
    """The operand pairs of the eval split (154 of the 400 sums of operands 0..19)."""
    rng = random.Random(EVAL_SUM_SEED)
    return frozenset(random_sum(rng, EVAL_SUM_MAX_OPERAND) for _ in range(EVAL_SUM_DRAWS))


def training_sum(rng: random.Random, max_operand: int) -> tuple[int, int]:
    """A random sum of operands 0..max_operand outside the eval split (drawn again until it is)."""
    while True:
        a, b = random_sum(rng, max_operand)
        if (a, b) not in held_out_sums():
            return a, b


def addition_fact(rng: random.Random, max_operand: int) -> str:
    """The fact "a + b = c" of a training sum (never one of the eval split)."""
    a, b = training_sum(rng, max_operand)
    return f"{a} + {b} = {a + b}"


def addition_example(rng: random.Random, max_operand: int) -> dict[str, str]:
    """A prompt/completion record of a training sum: {"prompt": "23 + 45 =", "completion": " 68"}."""
    prompt, _, answer = addition_fact(rng, max_operand).partition(" =")
    return {"prompt": prompt + " =", "completion": answer}


def sentence(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}."


def demo_corpus(
    num_records: int, seed: int = 0, max_operand: int = 49, arithmetic_share: float = 0.75
) -> Iterator[str]:
    """`num_records` texts: addition facts (share `arithmetic_share`) and templated sentences."""
    rng = random.Random(seed)
    for _ in range(num_records):
        yield addition_fact(rng, max_operand) if rng.random() < arithmetic_share else sentence(rng)


def demo_records(
    num_records: int, seed: int = 0, max_operand: int = 19, arithmetic_share: float = 0.9
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """The `dllm init` corpus: (text records of sentences, prompt/completion addition records)."""
    rng = random.Random(seed)
    texts: list[dict[str, str]] = []
    sums: list[dict[str, str]] = []
    for _ in range(num_records):
        if rng.random() < arithmetic_share:
            sums.append(addition_example(rng, max_operand))
        else:
            texts.append({"text": sentence(rng)})
    return texts, sums


def parse_sum_prompt(prompt: str) -> int | None:
    """The right answer of a prompt like "12 + 7 =", or None if it is not one."""
    left, eq, _ = prompt.partition("=")
    a, plus, b = left.partition("+")
    if not (eq and plus):
        return None
    try:
        return int(a) + int(b)
    except ValueError:
        return None


def first_int(text: str) -> int | None:
    """The first integer in a generated continuation (for scoring arithmetic answers)."""
    digits = ""
    for ch in text.strip():
        if ch.isdigit() or (ch == "-" and not digits):
            digits += ch
        elif digits:
            break
    try:
        return int(digits)
    except ValueError:
        return None
