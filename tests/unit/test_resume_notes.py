"""`dllm launch` over an existing run says where it resumes, and when the new config changes the learning-rate
plan (training.steps raised, say) what the LR schedule does: it is recomputed from the new config (a checkpoint
keeps only its step), so the LR jumps at the resume step; the line gives the two rates, which the metrics log
then shows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.training.metrics import read_metrics


def _launch(steps: int, capsys: pytest.CaptureFixture[str]) -> str:
    assert main(["launch", "--config", "train.yaml", "--set", f"training.steps={steps}"]) == 0
    return capsys.readouterr().err


def test_a_resume_says_its_step_and_what_a_new_training_steps_does_to_the_lr(
    train_yaml: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    monkeypatch.chdir(train_yaml.parent)
    run_dir = (train_yaml.parent / "runs" / "t").absolute()
    assert "resuming" not in _launch(3, capsys)  # a new run
    err = _launch(3, capsys)
    assert f"resuming {run_dir} at step 3 (step_00000003) of training.steps 3" in err
    assert "nothing to train: step 3 is at or past training.steps 3" in err and "LR schedule" not in err
    err = _launch(6, capsys)
    assert f"resuming {run_dir} at step 3 (step_00000003) of training.steps 6" in err
    [line] = [x for x in err.splitlines() if "LR schedule" in x]
    assert line.startswith("training.steps 3 -> 6: the LR schedule is recomputed from the new config over "
                           "training.steps 6 (a checkpoint keeps only its step)")  # fmt: skip
    assert "give training.steps its final value from the first launch" in line and "model.init_from" in line
    before, after = map(float, re.search(r"goes from (\S+) at step 3 to (\S+) at step 4", line).groups())
    lrs = {r["step"]: r["lr"] for r in read_metrics(run_dir)}
    assert before == pytest.approx(lrs[3], rel=1e-2) and after == pytest.approx(lrs[4], rel=1e-2)
    assert after > 1.5 * before  # the visible jump: cosine over 3 steps had decayed further than over 6
