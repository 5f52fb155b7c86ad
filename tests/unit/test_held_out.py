"""Held out by construction: the built-in tasks' eval splits are fixed, disjoint from what the project's
generators of training data emit (and from an rl run's prompts), and `dllm eval tasks --run` finds an
eval example in a run's training data before it calls a score held out."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.data.synthetic import demo_corpus, demo_records, held_out_sums, training_sum
from dllm.evaluation.overlap import found_in_artifact
from dllm.evaluation.tasks import BUILTIN, Example, in_eval_split, load_task
from dllm.recipes import GENERATORS
from dllm.tokenization.byte import ByteTokenizer

SUM_PROMPTS = {f"{a} + {b} =" for a, b in held_out_sums()}


def test_the_addition_eval_split_is_the_sums_it_always_scored():
    """154 sums; seed 0's first 200 examples are exactly the examples the task drew before it had a split,
    and every seed draws from the same 154."""
    assert len(held_out_sums()) == 154
    rng = random.Random("addition:0")
    before = [f"{a} + {b} =" for a, b in ((rng.randint(0, 19), rng.randint(0, 19)) for _ in range(200))]
    assert [e.prompt for e in load_task("addition", 200).examples] == before
    for seed in (1, 7):
        assert {e.prompt for e in load_task("addition", 300, seed).examples} <= SUM_PROMPTS


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_eval_and_train_splits_are_disjoint_and_fixed(name: str):
    evals = load_task(name, 60, seed=3).examples
    trains = load_task(name, 60, seed=3, split="train").examples
    assert all(in_eval_split(name, e.prompt) for e in evals) and not any(in_eval_split(name, e.prompt) for e in trains)
    assert not {e.prompt for e in evals} & {e.prompt for e in trains}
    assert [e.prompt for e in load_task(name, 60, seed=3).examples] == [e.prompt for e in evals]


def test_no_generator_of_training_data_emits_a_held_out_sum():
    texts = list(demo_corpus(5000, seed=2)) + [r["text"] for r in demo_records(3000, seed=2)[0]]
    prompts = [t.split(" = ")[0] + " =" for t in texts if " + " in t] + [r["prompt"] for r in demo_records(3000)[1]]
    for make in GENERATORS.values():
        for r in make(2000):
            if "prompt" in r:
                prompts.append(r["prompt"])
            elif "messages" in r:
                prompts.append(r["messages"][0]["content"].removeprefix("What is ").removesuffix("?") + " =")
    assert len(prompts) > 10_000 and not set(prompts) & SUM_PROMPTS
    rng = random.Random(0)
    assert all(training_sum(rng, 19) not in held_out_sums() for _ in range(2000))


def test_rl_prompts_of_a_built_in_task_come_from_its_train_split():
    from dllm.config.rl import PromptsConfig
    from dllm.rl.prompts import load_prompts

    task = load_prompts(PromptsConfig(task="addition", num_prompts=300), ByteTokenizer())
    assert not {e.prompt for e in task.examples} & SUM_PROMPTS


def _artifact(tmp_path: Path, records: list[dict], seq_len: int = 32) -> Path:
    """An artifact of the text records and the prompt/completion records (two sources)."""
    from dllm.config.loading import validate_config
    from dllm.config.prepare import PrepareSpec
    from dllm.data.prepare import prepare

    sources = []
    for name, fmt in (("texts", "text"), ("pairs", "prompt_completion")):
        mine = [r for r in records if ("text" in r) == (fmt == "text")]
        if mine:
            (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in mine))
            sources.append({"path": f"{name}.jsonl", "format": fmt})
    values = {"tokenizer": {"kind": "byte"}, "sources": sources, "output": "art", "seq_len": seq_len}
    prepare(validate_config(PrepareSpec, values, source="t", base_dir=tmp_path), tmp_path)
    return tmp_path / "art"


def test_an_example_is_found_in_an_artifact_whole_and_aligned(tmp_path: Path):
    """Found as a prompt/completion record or inside a text record; not found when only its prompt, or a
    prefix of its answer, is there."""
    from dllm.data.artifact import open_artifact

    records = [{"prompt": "3 + 4 =", "completion": " 7"}, {"text": "we know 10 + 10 = 20 by heart"},
               {"prompt": "5 + 5 =", "completion": " 11"}, {"prompt": "11 + 0 =", "completion": " 11"},
               {"text": "x 2 + 2 = 45"}]  # fmt: skip
    art = open_artifact(_artifact(tmp_path, records))
    examples = [Example("3 + 4 =", " 7"), Example("10 + 10 =", " 20"), Example("5 + 5 =", " 10"),
                Example("3 + 4 =", " 71"), Example("9 + 9 =", " 18"), Example("1 + 0 =", " 1"),
                Example("2 + 2 =", " 4")]  # fmt: skip
    # "1 + 0 = 1" inside "11 + 0 = 11" and "2 + 2 = 4" inside "2 + 2 = 45" are not whole occurrences
    assert found_in_artifact(art, ByteTokenizer(), examples) == [True, True, False, False, False, False, False]


def test_an_example_is_found_whatever_the_spacing_between_its_prompt_and_answer(tmp_path: Path):
    """20 training rows whose answers were written without the task's leading space ("Q: 3 + 3 =6" where the task
    has "Q: 3 + 3 =" -> " 6") are all found, and so are the reverse and a newline between them; a longer
    number, a different answer or another prompt still are not."""
    from dllm.data.artifact import open_artifact

    records = [{"prompt": f"Q: {a} + {a} =", "completion": f"{2 * a}"} for a in range(20)]
    records += [{"text": "so 30 + 1 =\n31 it is"}, {"prompt": "40 + 2 = ", "completion": " 42"}, {"text": "6 + 1 = 71"}]
    art = open_artifact(_artifact(tmp_path, records, seq_len=64))  # the text records whole in the first row
    tok = ByteTokenizer()
    assert all(found_in_artifact(art, tok, [Example(f"Q: {a} + {a} =", f" {2 * a}") for a in range(20)]))
    found = [Example("30 + 1 =", " 31"), Example("40 + 2 =", "42"), Example("40 + 2 =", "  42 ")]
    assert found_in_artifact(art, tok, found) == [True, True, True]
    absent = [
        Example("6 + 1 =", "7"),
        Example("Q: 3 + 3 =", "7"),
        Example("Q: 3 + 4 =", "6"),
        Example("R 3 + 3 =", "6"),
    ]
    assert found_in_artifact(art, tok, absent) == [False, False, False, False]


def test_eval_tasks_refuses_a_score_on_training_data_unless_allowed(tmp_path: Path, capsys):
    """A run trained on some eval sums: one line, exit 2, naming the count; --allow-overlap scores it and
    labels it a training-set score; a task with none of them is held out."""
    from dllm.config.loading import validate_config
    from dllm.config.spec import RunSpec
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import tiny_train_values

    leaked = [{"prompt": e.prompt, "completion": e.answer} for e in load_task("addition", 10).examples[:3]]
    clean = [{"prompt": "1 + 1 =", "completion": " 2"}] * 20
    _artifact(tmp_path, leaked + clean)
    values = tiny_train_values(run={"name": "r", "output_dir": str(tmp_path / "runs")}, training={"steps": 1},
                               data={"path": str(tmp_path / "art"), "seq_len": 32})  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    base = ["eval", "tasks", "--run", str(run_dir), "--limit", "10", "--gen-length", "4", "--json"]
    assert main([*base, "--tasks", "addition"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: --tasks addition: 3 of its 10 examples appear in the run's training data")
    assert err.count("\n") == 1 and "--allow-overlap" in err
    assert main([*base, "--tasks", "addition,copy", "--allow-overlap"]) == 0
    out, err = capsys.readouterr()
    summaries = {s["name"]: s for s in map(json.loads, out.splitlines())}
    assert summaries["addition"]["train_overlap"] == 3 and summaries["copy"]["train_overlap"] == 0
    assert "addition: TRAINING-SET SCORE: 3 of its 10" in err and "copy: held out: none of its 10" in err
