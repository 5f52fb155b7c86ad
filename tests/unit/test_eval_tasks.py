"""Exact-answer tasks (evaluation/tasks.py): generated examples, JSONL tasks, scoring and counters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.errors import DataError
from dllm.evaluation.tasks import BUILTIN, is_correct, load_task, run_task
from dllm.sampling.results import Counters


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


def test_gsm8k_format_records_score_the_final_number(tmp_path: Path):
    """GSM8K's {"question", "answer": "... #### N"}: the prompt is the question, the reference N, and an
    output is right when its final number equals N, whichever way it marks it."""
    from dllm.evaluation.tasks import GSM8K_NEW_TOKENS, final_number

    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1,200 * 2 = 2400\n#### 2,400"},
    ]
    path = tmp_path / "gsm8k.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(str(path), limit=10)
    assert [e.prompt for e in task.examples] == [r["question"] for r in rows]
    assert [e.answer for e in task.examples] == ["7", "2400"]
    assert task.stop_strings == () and task.max_new_tokens == GSM8K_NEW_TOKENS
    first, second = task.examples
    assert first.correct("He has 3 + 4 = 7 apples.\n#### 7")
    assert first.correct("So the answer is \\boxed{7}.") and first.correct("3 and 4 make 7.0")
    assert not first.correct("3 + 4 = 7, then 8") and not first.correct("#### 8 (not 7)")
    assert not first.correct("no number here")
    assert second.correct("2 x 1,200 = #### 2,400") and second.correct("The total is 2400 pens.")
    assert final_number("#### -3.5 then 9") == "-3.5" and final_number("") is None
    path.write_text('{"question": "no final answer", "answer": "it is 7"}\n')
    with pytest.raises(DataError, match=r"gsm8k.jsonl:1: a GSM8K record needs"):
        load_task(str(path), limit=10)
