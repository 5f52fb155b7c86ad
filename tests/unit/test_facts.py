"""The chat tasks of instruct models (evaluation/facts.py): fixed, disjoint eval and train splits of each
table; verifiers that accept the reference inside a sentence and refuse near misses; chat prompts decoded
through the model's chat template; and a run trained on some eval questions (its own answers after them,
not the reference) refused by `dllm eval tasks --run` until --allow-overlap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.evaluation import facts
from dllm.evaluation.overlap import found_in_artifact
from dllm.evaluation.tasks import Example, in_eval_split, load_task
from dllm.tokenization.byte import ByteTokenizer
from tests.unit.test_held_out import _artifact


@pytest.mark.parametrize("name", sorted(facts.TABLES))
def test_splits_are_fixed_disjoint_and_cover_the_table(name: str):
    evals = load_task(name, 10_000, seed=0).examples
    trains = load_task(name, 10_000, seed=0, split="train").examples
    table = {prompt for prompt, _, _ in facts.TABLES[name]()}
    assert {e.prompt for e in evals} | {e.prompt for e in trains} == table
    assert not {e.prompt for e in evals} & {e.prompt for e in trains} and len(evals) >= 20
    assert all(in_eval_split(name, e.prompt) for e in evals)
    assert {e.prompt for e in load_task(name, 10_000, seed=5).examples} == {e.prompt for e in evals}  # any seed
    assert load_task(name, 5).chat and load_task(name, 5).stop_strings == ()
    assert all(e.correct(e.answer) for e in evals + trains)  # the reference itself is right


def test_verifiers_read_an_instruct_models_sentences():
    city = Example("", "Buenos Aires", lambda o: facts.names(o, "Buenos Aires"))
    assert city.correct("The capital of Argentina is Buenos Aires.") and city.correct("buenos aires")
    assert not city.correct("Buenos") and not city.correct("The capital is Cordoba, not Buenos Airesville.")
    assert facts.last_number_is("The answer is 1,200 centimeters.", "1200")
    assert facts.last_number_is("12 times 100 is 1200", "1200")  # worked out: its last number is the result
    assert not facts.last_number_is("1200 is not it, 1300 is", "1200")
    assert facts.first_yes_or_no_is("Yes, it is. No doubt.", "yes") and not facts.first_yes_or_no_is("Nope.", "no")
    assert facts.names("The reversed word is 'elppa'.", "elppa") and not facts.names("elpp a", "elppa")


def test_a_chat_question_is_found_in_training_records_whatever_follows_it(tmp_path: Path):
    """A chat task's training records hold the question and a model's own answer, never the reference: the
    question alone is looked up."""
    from dllm.data.artifact import open_artifact

    ex = load_task("capitals", 3).examples
    records = [{"prompt": ex[0].prompt, "completion": " I think it is a big city."},
               {"text": f"user: {ex[1].prompt}\nassistant: hmm"}]  # fmt: skip
    art = open_artifact(_artifact(tmp_path, records, seq_len=128))
    assert found_in_artifact(art, ByteTokenizer(), ex, question_only=True) == [True, True, False]
    assert found_in_artifact(art, ByteTokenizer(), ex) == [False, False, False]  # not with the reference after


def test_eval_tasks_decodes_chat_tasks_through_the_template_and_checks_the_questions(tmp_path: Path, capsys):
    from dllm.config.loading import validate_config
    from dllm.config.spec import RunSpec
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import tiny_train_values

    leaked = [{"prompt": e.prompt, "completion": " no idea"} for e in load_task("yesno", 4).examples[:2]]
    _artifact(tmp_path, leaked + [{"prompt": "Is it?", "completion": " yes"}] * 150, seq_len=128)
    data = {"path": str(tmp_path / "art"), "seq_len": 128}
    values = tiny_train_values(run={"name": "r", "output_dir": str(tmp_path / "runs")}, training={"steps": 1},
                               data=data, model={"max_seq_len": 256})  # fmt: skip
    spec, _ = resolve_run_spec(validate_config(RunSpec, values, source="train.yaml", base_dir=tmp_path))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    base = ["eval", "tasks", "--run", str(run_dir), "--limit", "4", "--gen-length", "4", "--json"]
    assert main([*base, "--tasks", "yesno"]) == 2
    assert "2 of its 4 examples appear in the run's training data" in capsys.readouterr().err
    out_file = tmp_path / "outputs.jsonl"
    assert main([*base, "--tasks", "yesno,units", "--allow-overlap", "--output", str(out_file)]) == 0
    summaries = {s["name"]: s for s in map(json.loads, capsys.readouterr().out.splitlines())}
    assert summaries["yesno"]["train_overlap"] == 2 and summaries["units"]["train_overlap"] == 0
    assert {json.loads(line)["task"] for line in out_file.read_text().splitlines()} == {"yesno", "units"}
