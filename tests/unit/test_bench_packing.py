"""bench/packing.py runs end to end on a few steps: every variant trained and scored on held-out prompts."""

from __future__ import annotations

from bench.packing import VARIANTS, main, task


def test_the_eval_prompts_are_held_out():
    train, evals = task(3000, 100, seed=0)
    assert len({e.prompt for e in evals}) == 100 and not {e.prompt for e in evals} & {e.prompt for e in train}


def test_the_bench_reports_every_variant(capsys):
    out = main(["--steps", "2", "--batch", "4", "--preset", "tiny", "--num-train", "120", "--num-eval", "6"])
    assert capsys.readouterr().out.count("\n") == 1  # one JSON line
    assert out["held_out"] == {"eval_prompts": 6, "eval_prompts_in_training_records": 0, "found_in_artifacts": 0}
    for name in VARIANTS:
        assert 0 <= out[name]["length_accuracy"] <= 1 and out[name]["rows"] > 0
    assert out["split"]["split_across_rows"] > 0 and out["whole"]["split_across_rows"] == 0
    assert out["whole"]["packing"] == "whole" and out["indexed"]["records_per_row"] == 1.0
