"""Reliability hardening, the metrics log: metrics.jsonl is crash-consistent. A line torn by a kill used to crash the
resume; a run killed before its first checkpoint, or restarted with `resume: never`, appended a
second copy of its steps. Now a torn line is skipped, the log is cut back to the step a run starts
from, and a start from scratch keeps the old log aside (metrics.jsonl.1), never deleting it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.training.metrics import read_metrics
from tests.helpers import tiny_train_values, write_yaml
from tests.reliability.launch_helpers import SMALL


@pytest.fixture
def run_dir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    write_yaml(workdir / "train.yaml", tiny_train_values(**SMALL))  # 4 steps, a checkpoint every 2
    monkeypatch.chdir(workdir)
    return workdir / "runs" / "t"


def _launch(*overrides: str) -> None:
    assert main(["launch", "--config", "train.yaml", *(a for o in overrides for a in ("--set", o))]) == 0


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_torn_last_line_does_not_stop_the_resume(run_dir: Path):
    _launch()
    whole = read_metrics(run_dir)
    # as if killed while writing step 4's record, after the checkpoint of step 2
    log = run_dir / "metrics.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("".join(line + "\n" for line in lines[:3]) + lines[3][:25])
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]  # the torn line is skipped
    (run_dir / "checkpoints" / "latest").write_text("step_00000002\n")
    shutil.rmtree(run_dir / "checkpoints" / "step_00000004")
    _launch()
    assert _steps(log) == [1, 2, 3, 4]
    assert [r["loss"] for r in read_metrics(run_dir)] == [r["loss"] for r in whole]  # bit-exact resume


def test_a_run_killed_before_its_first_checkpoint_starts_a_fresh_log(run_dir: Path):
    no_checkpoint = ("checkpointing.every_steps=100", "checkpointing.save_final=false", "training.steps=3")
    _launch(*no_checkpoint)
    _launch(*no_checkpoint)  # starts again from step 0: there is nothing to resume from
    assert _steps(run_dir / "metrics.jsonl") == [1, 2, 3]
    assert _steps(run_dir / "metrics.jsonl.1") == [1, 2, 3]  # the first attempt's log, kept aside


def test_resume_never_keeps_the_old_log_aside(run_dir: Path):
    _launch()
    _launch("checkpointing.resume=never", "training.steps=2")
    assert _steps(run_dir / "metrics.jsonl") == [1, 2]
    assert _steps(run_dir / "metrics.jsonl.1") == [1, 2, 3, 4]
    _launch("checkpointing.resume=never", "training.steps=2")
    assert _steps(run_dir / "metrics.jsonl.2") == [1, 2]  # an earlier one is never overwritten
