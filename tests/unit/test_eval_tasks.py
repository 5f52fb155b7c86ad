"""Exact-answer tasks (evaluation/tasks.py): generated examples, JSONL tasks, scoring and counters."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm.errors import DataError
from dllm.evaluation.tasks import BUILTIN, is_correct, load_task, run_task
from dllm.sampling.generate import Counters


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_tasks_are_seeded_and_have_exact_answers(name):
    a, b = load_task(name, 20, seed=0), load_task(name, 20, seed=0)
    assert a.examples == b.examples and len(a.examples) == 20
    assert load_task(name, 20, seed=1).examples != a.examples
    for ex in a.examples:
        assert ex.prompt and ex.answer.startswith(" ") and "\n" not in ex.answer
        if name.startswith("addition"):
            x, _, y = ex.prompt.removesuffix(" =").partition(" + ")
            assert int(ex.answer) == int(x) + int(y)
        if name == "copy":
            assert ex.answer.strip() == ex.prompt.removeprefix("copy: ").removesuffix(" ->")


def test_jsonl_tasks_and_their_errors(tmp_path: Path):
    (tmp_path / "mine.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": "2+2=", "answer": "4"}\n')
    task = load_task(str(tmp_path / "mine.jsonl"), limit=1)
    assert task.name == "mine" and [e.answer for e in task.examples] == ["2"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1: expected"):
        load_task(str(tmp_path / "bad.jsonl"), 5)
    with pytest.raises(DataError, match="neither a built-in task"):
        load_task("no-such-task", 5)


def test_run_task_scores_exact_matches_and_counts_forwards():
    task = load_task("addition", 5)
    answers = [e.answer for e in task.examples]

    def generate_batch(prompts):
        outs = [answers[task.examples.index(next(e for e in task.examples if e.prompt == p))] for p in prompts]
        outs[0] = outs[0] + "0"  # one wrong answer per batch
        return outs, Counters(nfe=4, tokens_committed=8 * len(prompts))

    res = run_task(task, generate_batch, batch_size=2)  # batches of 2, 2, 1: three wrong
    assert (res.correct, res.examples, res.accuracy) == (2, 5, 0.4)
    assert res.nfe_per_call == 4 and res.forwards_per_answer == pytest.approx(12 / 5)
    assert res.tokens_per_forward == pytest.approx(40 / 12)
    assert [o["correct"] for o in res.outputs] == [False, True, False, True, False]
    assert is_correct("  42\n", " 42") and not is_correct("42.", "42")
