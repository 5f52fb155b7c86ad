"""Countdown and 4x4 sudoku (evaluation/puzzles.py) and their verifiers, on hand-made right and wrong answers."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from dllm.evaluation.puzzles import (
    count_solutions,
    countdown_correct,
    make_countdown,
    make_sudoku4,
    parse_expression,
    sudoku4_correct,
)
from dllm.evaluation.tasks import Example, Task, extract_answer, load_task, run_task
from dllm.sampling.results import Counters


def test_expression_parser_is_exact_and_refuses_anything_else():
    assert parse_expression("(3+4)*2/7") == (Fraction(2), [3, 4, 2, 7])
    assert parse_expression(" 1 / 3 + 1 / 3 ") == (Fraction(2, 3), [1, 3, 1, 3])  # exact, no float rounding
    assert parse_expression("10-2-3") == (Fraction(5), [10, 2, 3])  # left-associative
    assert parse_expression("2+3*4") == (Fraction(14), [2, 3, 4])  # precedence
    for bad in ("", "3**2", "-3+4", "3+", "(3+4", "3+4)", "3 4", "2.5*2", "__import__('os')", "x+1", "1e3",
                "4/(3-3)", "1234567", "(" * 5000 + "1" + ")" * 5000):  # fmt: skip
        assert parse_expression(bad) is None, bad


def test_countdown_verifier_on_hand_made_answers():
    numbers, target = (3, 7, 25), 82
    assert countdown_correct("25*3+7", numbers, target)
    assert countdown_correct(" (25 * 3) + 7 ", numbers, target)
    assert countdown_correct("7+3*25", numbers, target)
    assert not countdown_correct("25*3+7+7-7", numbers, target)  # 7 used three times
    assert not countdown_correct("82", numbers, target)  # 82 is not given
    assert not countdown_correct("25*(3+7)", numbers, target)  # 250
    assert not countdown_correct("25*3+7=82", numbers, target)
    assert not countdown_correct("80+2", numbers, target)
    assert countdown_correct("6/3*4", (6, 3, 4), 8) and not countdown_correct("6/4*3", (6, 3, 4), 8)
    assert countdown_correct("14*19*19", (19, 14, 19), 5054)  # a number given twice may be used twice
    assert countdown_correct("12", (12, 5, 3), 12)  # at most once: a subset of the numbers is fine


def test_generated_countdown_and_sudoku_have_verified_references():
    rng = random.Random(0)
    for _ in range(30):
        prompt, answer, numbers, target = make_countdown(rng)
        assert prompt == f"countdown {' '.join(map(str, numbers))} -> {target} ="
        assert countdown_correct(answer, numbers, target) and target not in numbers
        prompt, answer, puzzle = make_sudoku4(rng)
        assert count_solutions(puzzle) == 1 and 0 in puzzle
        assert sudoku4_correct(answer, puzzle) and prompt.startswith("sudoku ")


def test_sudoku_verifier_on_hand_made_answers():
    puzzle = tuple(int(c) if c != "." else 0 for c in "1.3. .41. .1.. 4.2.".replace(" ", ""))
    assert count_solutions(puzzle) == 1
    right = "1234 3412 2143 4321"
    assert sudoku4_correct(right, puzzle) and sudoku4_correct(" 1234341221434321\n", puzzle)
    assert not sudoku4_correct("1432 3214 2143 4321", puzzle)  # valid grid, but a given (the 4 of row 2) moved
    assert not sudoku4_correct("1234 3412 2143 4312", puzzle)  # last row: columns repeat
    assert not sudoku4_correct("1234 1234 1234 1234", tuple([0] * 16))  # rows fine, columns not
    assert not sudoku4_correct("1234 3412 2143 432", puzzle)
    assert not sudoku4_correct("1234 3412 2143 4321 1", puzzle)
    assert not sudoku4_correct("1234 3412 2143 4325", puzzle)
    other = "2143 4321 1234 3412"  # a valid grid, but not this puzzle's givens
    assert sudoku4_correct(other, tuple([0] * 16)) and not sudoku4_correct(other, puzzle)


def test_tasks_score_through_the_verifier():
    task = load_task("countdown", 4, seed=0)
    first = task.examples[0]
    assert first.verify is not None and first.correct(first.answer)
    numbers = [int(n) for n in first.prompt.split()[1:4]]
    assert not first.correct(" + ".join(map(str, numbers)) + " + 1")

    def generate_batch(prompts):  # the reference for every prompt but a wrong one for the first
        outs = [next(e.answer for e in task.examples if e.prompt == p) for p in prompts]
        return ["(" + outs[0].strip() + ")+1"] + outs[1:], Counters(nfe=1, tokens_committed=1)

    res = run_task(task, generate_batch, batch_size=4)
    assert res.correct == 3
    plain = Example("1 + 1 =", " 2")
    assert plain.correct(" 2 ") and not plain.correct("3")
    assert extract_answer(Task("t", [plain], 8), " 2\nmore text") == " 2"


@pytest.mark.parametrize("name", ["countdown", "sudoku4"])
def test_puzzle_tasks_fit_their_generation_length(name):
    task = load_task(name, 20)
    assert max(len(e.answer) for e in task.examples) <= task.max_new_tokens  # bytes: one token per character
