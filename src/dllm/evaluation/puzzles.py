"""Generated puzzles with exact verifiers: countdown and 4x4 sudoku (the RL tasks of d1, Zhao et al. 2025).

Their answers are not unique strings (countdown) or are checked by the rules (sudoku), so each example
carries its verifier (`Example.verify` in tasks.py) instead of being compared with the reference answer.

- countdown: "countdown 3 7 25 -> 82 =" -> an arithmetic expression over the given numbers, each used at
  most once (as often as it is given), with + - * / and parentheses, whose value is exactly the target.
  The expression is parsed by a small recursive-descent parser over exact fractions: nothing is
  evaluated by Python, and anything else (names, powers, unknown or reused numbers) is wrong.
- sudoku4: "sudoku 12.. ..1. .3.. ..43 ->" (rows, "." empty) -> the solved grid " 1234 3412 2143 4321";
  every puzzle has exactly one solution, and the verifier checks rows, columns, 2x2 boxes and the givens.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from fractions import Fraction

_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """(exact value, the integer literals used) of an arithmetic expression, or None when it is not one
    (any other character, a syntax error, a division by zero, a literal longer than 6 digits)."""
    tokens: list[str | int] = []
    pos, text = 0, text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        if m.group(1) is not None:
            if len(m.group(1)) > 6:
                return None
            tokens.append(int(m.group(1)))
        else:
            tokens.append(m.group(2))
        pos = m.end()
    literals: list[int] = []
    try:
        value, end = _sum(tokens, 0, literals)
    except (_Invalid, ZeroDivisionError, RecursionError):
        return None
    return (value, literals) if end == len(tokens) else None


class _Invalid(Exception):
    pass


def _sum(tokens, i: int, literals: list[int]) -> tuple[Fraction, int]:
    """sum := product (('+' | '-') product)*"""
    value, i = _product(tokens, i, literals)
    while i < len(tokens) and tokens[i] in ("+", "-"):
        rhs, j = _product(tokens, i + 1, literals)
        value, i = (value + rhs if tokens[i] == "+" else value - rhs), j
    return value, i


def _product(tokens, i: int, literals: list[int]) -> tuple[Fraction, int]:
    """product := atom (('*' | '/') atom)*"""
    value, i = _atom(tokens, i, literals)
    while i < len(tokens) and tokens[i] in ("*", "/"):
        rhs, j = _atom(tokens, i + 1, literals)
        value, i = (value * rhs if tokens[i] == "*" else value / rhs), j
    return value, i


def _atom(tokens, i: int, literals: list[int]) -> tuple[Fraction, int]:
    """atom := integer | '(' sum ')'   (no unary minus: countdown combines the given positive numbers)"""
    if i >= len(tokens):
        raise _Invalid
    tok = tokens[i]
    if isinstance(tok, int):
        literals.append(tok)
        return Fraction(tok), i + 1
    if tok == "(":
        value, j = _sum(tokens, i + 1, literals)
        if j >= len(tokens) or tokens[j] != ")":
            raise _Invalid
        return value, j + 1
    raise _Invalid


def countdown_correct(output: str, numbers: tuple[int, ...], target: int) -> bool:
    """The output is an expression whose value is `target`, using only `numbers`, each at most once."""
    parsed = parse_expression(output)
    if parsed is None:
        return False
    value, used = parsed
    return value == target and not Counter(used) - Counter(numbers)


def make_countdown(rng: random.Random) -> tuple[str, str, tuple[int, ...], int]:
    """(prompt, reference answer, numbers, target): three numbers 1..20 combined with + - * into a
    positive target that is not one of the numbers (so no single number answers it)."""
    while True:
        numbers = tuple(rng.randint(1, 20) for _ in range(3))
        a, b, c = rng.sample(numbers, 3)
        op1, op2 = rng.choice("+-*"), rng.choice("+-*")
        expr = f"({a}{op1}{b}){op2}{c}" if rng.random() < 0.5 else f"{a}{op1}{b}{op2}{c}"
        parsed = parse_expression(expr)
        assert parsed is not None
        target = parsed[0]
        if target.denominator == 1 and target > 0 and int(target) not in numbers:
            prompt = f"countdown {' '.join(map(str, numbers))} -> {int(target)} ="
            return prompt, " " + expr, numbers, int(target)


# --------------------------------------------------------------------------------------------------
# sudoku 4x4

Grid = tuple[int, ...]  # 16 cells, row-major, 0 = empty


def _fits(grid: list[int], cell: int, d: int) -> bool:
    r, c = divmod(cell, 4)
    box = [(r // 2 * 2 + i // 2) * 4 + c // 2 * 2 + i % 2 for i in range(4)]
    peers = [r * 4 + k for k in range(4)] + [k * 4 + c for k in range(4)] + box
    return all(grid[p] != d for p in peers if p != cell)


def count_solutions(grid: Grid, limit: int = 2) -> int:
    """Solutions of a puzzle, counted up to `limit` (backtracking; 4x4 is tiny)."""
    cells = list(grid)

    def solve() -> int:
        try:
            cell = cells.index(0)
        except ValueError:
            return 1
        found = 0
        for d in range(1, 5):
            if _fits(cells, cell, d):
                cells[cell] = d
                found += solve()
                cells[cell] = 0
                if found >= limit:
                    break
        return found

    return solve()


def make_sudoku4(rng: random.Random) -> tuple[str, str, Grid]:
    """(prompt, the solution as the answer, the puzzle): a random solved grid with clues removed in random
    order while the solution stays unique."""
    base = [1, 2, 3, 4, 3, 4, 1, 2, 2, 1, 4, 3, 4, 3, 2, 1]  # a valid grid; the symmetries below keep it valid
    digits = rng.sample(range(1, 5), 4)
    bands, stacks = rng.sample([0, 1], 2), rng.sample([0, 1], 2)
    rows = [band * 2 + r for band in bands for r in rng.sample([0, 1], 2)]
    cols = [stack * 2 + c for stack in stacks for c in rng.sample([0, 1], 2)]
    solution = tuple(digits[base[r * 4 + c] - 1] for r in rows for c in cols)
    puzzle = list(solution)
    for cell in rng.sample(range(16), 16):
        keep, puzzle[cell] = puzzle[cell], 0
        if count_solutions(tuple(puzzle)) != 1:
            puzzle[cell] = keep
    prompt = "sudoku " + _rows(tuple(puzzle)) + " ->"
    return prompt, " " + _rows(solution), tuple(puzzle)


def _rows(grid: Grid) -> str:
    return " ".join("".join(str(d) if d else "." for d in grid[r * 4 : r * 4 + 4]) for r in range(4))


def sudoku4_correct(output: str, puzzle: Grid) -> bool:
    """The output is 16 digits (rows, optionally spaced) forming a valid grid that keeps the givens."""
    text = output.strip()
    if not re.fullmatch(r"[1-4]{4}( [1-4]{4}){3}|[1-4]{16}", text):
        return False
    grid = [int(ch) for ch in text if ch != " "]
    if any(g and g != d for g, d in zip(puzzle, grid, strict=True)):
        return False
    return all(_fits(grid, cell, grid[cell]) for cell in range(16))
