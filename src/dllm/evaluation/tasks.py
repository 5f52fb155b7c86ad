"""Tasks with exact answers: built-in generated ones and user JSONL files, scored through any sampler.

Built-in tasks are generated from a seed, so every run scores the same examples, and each has a fixed
eval split that no generator of training data in the project emits (held out by construction):
- `addition`: "a + b =" -> " a+b" with operands 0..19 (the format `dllm init` / `make demo` trains on);
  its eval split is the 154 sums of data/synthetic.py's `held_out_sums`, its train split the other 246;
- `addition3`: the same with three-digit operands (multi-digit carries);
- `copy`: "copy: <word> ->" -> " <word>" (random lowercase words of 4-8 letters);
- `pattern`: a cycle of 2-3 words shown twice and cut, "-> " the next three words;
- `countdown`, `sudoku4`: puzzles with many right answers or rule-checked ones (evaluation/puzzles.py),
  each example carrying its exact verifier.
- `capitals`, `arithmetic`, `units`, `reverse`, `yesno`: chat questions for instruct models from tables in
  the project (evaluation/facts.py), each right when its verifier accepts the answer.
The other built-in tasks split by a stable hash of the prompt: a quarter of the prompts are the eval
split (`in_eval_split`). `load_task` draws the eval split by default; an rl run draws its prompts from
the train split. A user task is a JSONL file of {"prompt": ..., "answer": ...} records, or of GSM8K-format records
{"question": ..., "answer": "<worked solution> #### <number>"}: the question is the prompt, the number
after "####" the reference, and an output is right when its final number (after its own last "####",
else in its last \\boxed{...}, else its last number; thousands commas dropped) equals it; such a task
has no stop string (solutions span lines) and 256 new tokens by default.

An output is right when the generated text, cut at the first stop string (a newline by default) and
EOS, equals the answer after stripping surrounding whitespace on both, or, for an example with a
verifier, when the verifier accepts it.
"""

from __future__ import annotations

import hashlib
import random
import re
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from dllm.data.synthetic import EVAL_SUM_MAX_OPERAND, held_out_sums, random_sum
from dllm.errors import DataError
from dllm.evaluation import facts, puzzles

WORDS = ("red", "blue", "green", "cat", "dog", "sun", "moon", "tree", "fish", "star", "rain", "snow")


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str
    """The reference answer (one right answer when the example has a verifier)."""
    verify: Callable[[str], bool] | None = field(default=None, compare=False, repr=False)
    """Exact check of an output (cut at the stop strings) for answers that are not one string; None:
    the output must equal `answer` (after stripping)."""

    def correct(self, output: str) -> bool:
        """Whether `output` (cut at the task's stop strings) answers this example."""
        return self.verify(output) if self.verify is not None else is_correct(output, self.answer)


@dataclass(frozen=True)
class Task:
    name: str
    examples: list[Example]
    max_new_tokens: int
    """Default generation length (the sampler's gen_length unless the user sets one)."""
    stop_strings: tuple[str, ...] = ("\n",)
    chat: bool = False
    """Each prompt is a user turn, decoded through the model's chat template (facts.py's tasks)."""


def _addition(rng: random.Random, hi: int) -> Example:
    a, b = random_sum(rng, hi)
    return Example(f"{a} + {b} =", f" {a + b}")


def _copy(rng: random.Random) -> Example:
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(4, 8)))
    return Example(f"copy: {word} ->", f" {word}")


def _pattern(rng: random.Random) -> Example:
    cycle = rng.sample(WORDS, rng.randint(2, 3))
    shown = (cycle * 3)[: 2 * len(cycle) + 1]
    nxt = (cycle * 4)[len(shown) : len(shown) + 3]
    return Example(" ".join(shown) + " ->", " " + " ".join(nxt))


def _countdown(rng: random.Random) -> Example:
    prompt, answer, numbers, target = puzzles.make_countdown(rng)
    return Example(prompt, answer, partial(puzzles.countdown_correct, numbers=numbers, target=target))


def _sudoku4(rng: random.Random) -> Example:
    prompt, answer, puzzle = puzzles.make_sudoku4(rng)
    return Example(prompt, answer, partial(puzzles.sudoku4_correct, puzzle=puzzle))


BUILTIN: dict[str, tuple[Callable[[random.Random], Example], int]] = {
    "addition": (lambda r: _addition(r, EVAL_SUM_MAX_OPERAND), 8),
    "addition3": (lambda r: _addition(r, 999), 8),
    "copy": (_copy, 16),
    "pattern": (_pattern, 24),
    "countdown": (_countdown, 16),
    "sudoku4": (_sudoku4, 24),
}


Split = Literal["eval", "train"]
EVAL_SHARE = 4
"""One prompt in EVAL_SHARE of a hash-split task is in its eval split."""


def in_eval_split(name: str, prompt: str) -> bool:
    """Whether a built-in task's example belongs to its eval split (fixed: not a function of any seed)."""
    if name == "addition":
        a, _, b = prompt.removesuffix(" =").partition(" + ")
        return (int(a), int(b)) in held_out_sums()
    digest = hashlib.sha256(f"{name}:{prompt}".encode()).digest()
    share = facts.EVAL_SHARE if name in facts.TABLES else EVAL_SHARE
    return int.from_bytes(digest[:4], "little") % share == 0


def load_task(name_or_path: str, limit: int, seed: int = 0, split: Split = "eval") -> Task:
    """A built-in task (`limit` examples of its `split`, generated from `seed`) or a JSONL file of
    prompt/answer records (all of it: a user's file is its own split)."""
    if name_or_path in facts.TABLES:
        return chat_task(name_or_path, limit, seed, split)
    if name_or_path in BUILTIN:
        make, max_new = BUILTIN[name_or_path]
        rng = random.Random(f"{name_or_path}:{seed}")
        examples: list[Example] = []
        while len(examples) < limit:  # the generator's draws, those of other split skipped
            ex = make(rng)
            if in_eval_split(name_or_path, ex.prompt) == (split == "eval"):
                examples.append(ex)
        return Task(name_or_path, examples, max_new)
    path = Path(name_or_path)
    if not path.is_file():
        builtin = ", ".join([*BUILTIN, *facts.TABLES])
        raise DataError(f"--tasks: {name_or_path!r} is neither a built-in task ({builtin}) nor a JSONL file")
    from dllm.data.prepare.sources import jsonl_records  # file:line errors for bad JSON, .gz too

    examples = []
    for rec in jsonl_records(path):
        if "question" in rec.data and "prompt" not in rec.data:
            examples.append(_gsm8k_example(rec.data, rec.where))
        else:
            prompt, answer = rec.data.get("prompt"), rec.data.get("answer")
            if not isinstance(prompt, str) or not isinstance(answer, str):
                raise DataError(
                    f'{rec.where}: expected {{"prompt": "...", "answer": "..."}} (or GSM8K\'s {{"question", "answer"}})'
                )
            examples.append(Example(prompt, answer))
        if len(examples) >= limit:
            break
    if not examples:
        raise DataError(f"{path}: no records")
    if any(e.verify is not None for e in examples):  # GSM8K-format: worked solutions over several lines
        return Task(path.stem, examples, GSM8K_NEW_TOKENS, stop_strings=())
    longest = max(len(e.answer) for e in examples)
    return Task(path.stem, examples, max(8, longest + 4))


def chat_task(name: str, limit: int, seed: int = 0, split: Split = "eval") -> Task:
    """A table task of facts.py: `limit` items of its `split` (all when fewer), in an order drawn from `seed`."""
    items = [it for it in facts.TABLES[name]() if in_eval_split(name, it[0]) == (split == "eval")]
    random.Random(f"{name}:{seed}").shuffle(items)
    examples = [Example(prompt, answer, verify) for prompt, answer, verify in items[:limit]]
    return Task(name, examples, facts.MAX_NEW_TOKENS, stop_strings=(), chat=True)


GSM8K_NEW_TOKENS = 256
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def final_number(text: str) -> str | None:
    """The final answer of a worked solution: the first number after its last "####", else the last number
    in its last \\boxed{...}, else its last number; thousands commas dropped; None when it has none."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return found[0].replace(",", "") if found else None
    boxed = _BOXED.findall(text)
    found = _NUMBER.findall(boxed[-1] if boxed else text)
    return found[-1].replace(",", "") if found else None


def same_number(output: str, reference: str) -> bool:
    """Whether `output`'s final number equals the number `reference` (numerically: 72 == 72.0)."""
    got = final_number(output)
    if got is None:
        return False
    try:
        return float(got) == float(reference)
    except ValueError:
        return False


def _gsm8k_example(data: dict[str, Any], where: str) -> Example:
    question, solution = data.get("question"), data.get("answer")
    reference = final_number(solution) if isinstance(solution, str) and "####" in solution else None
    if not isinstance(question, str) or reference is None:
        raise DataError(f'{where}: a GSM8K record needs "question" and an "answer" that ends with "#### <number>"')
    return Example(question, reference, verify=partial(same_number, reference=reference))


def is_correct(output: str, answer: str) -> bool:
    return output.strip() == answer.strip()


def extract_answer(task: Task, text: str) -> str:
    """The answer part of a generated text: before the first of the task's stop strings."""
    from dllm.sampling.stops import cut_at_stop

    return cut_at_stop(text, list(task.stop_strings))


@dataclass
class TaskResult:
    name: str
    accuracy: float
    examples: int
    correct: int
    nfe_per_call: float
    forwards_per_answer: float
    tokens_per_forward: float
    wall_s: float
    edits_per_answer: float = 0.0
    """Edit Flows: insertions, deletions and substitutions drawn per answer (0 for the canvas samplers)."""
    train_overlap: int | None = None
    """Examples found verbatim in the run's training data (evaluation/overlap.py); 0: held out; None: not checked."""
    outputs: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "outputs"}
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}


def run_task(
    task: Task,
    generate_batch: Callable[[list[str]], tuple[list[str], Any]],
    batch_size: int,
) -> TaskResult:
    """Generate every prompt (batches of `batch_size`) and score exact matches. `generate_batch`
    returns (decoded outputs cut at the stop strings, the call's Counters)."""
    outputs, nfe, calls, committed, right, edits = [], 0, 0, 0, 0, 0
    t0 = time.perf_counter()
    for i in range(0, len(task.examples), batch_size):
        chunk = task.examples[i : i + batch_size]
        texts, counters = generate_batch([e.prompt for e in chunk])
        nfe += counters.nfe
        committed += counters.tokens_committed
        edits += getattr(counters, "edits", 0)
        calls += 1
        for ex, out in zip(chunk, texts, strict=True):
            ok = ex.correct(out)
            right += ok
            outputs.append({"task": task.name, "prompt": ex.prompt, "answer": ex.answer, "output": out, "correct": ok})
    wall = time.perf_counter() - t0
    n = len(task.examples)
    return TaskResult(
        name=task.name, accuracy=right / n, examples=n, correct=right, nfe_per_call=nfe / calls,
        forwards_per_answer=nfe / n, tokens_per_forward=committed / max(nfe, 1), wall_s=wall,
        edits_per_answer=edits / n, outputs=outputs,
    )  # fmt: skip
