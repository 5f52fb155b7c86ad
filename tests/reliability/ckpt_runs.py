"""Tiny trained runs and an in-process CLI for the checkpoint reliability tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.training.preflight import resolve_run_spec
from dllm.training.run import prepare_run_dir, train_from_run_dir
from tests.helpers import load_spec, tiny_train_values, write_yaml

STEP2 = "step_00000002"


def trained_run(workdir: Path, *overrides: str) -> Path:
    """A run trained for 2 steps with a checkpoint at step 2 (more with overrides); its folder."""
    spec, _ = resolve_run_spec(load_spec(train_yaml(workdir), "training.steps=2", *overrides))
    run_dir = prepare_run_dir(spec)
    train_from_run_dir(run_dir)
    return run_dir


def train_yaml(workdir: Path) -> Path:
    return write_yaml(workdir / "train.yaml", tiny_train_values())


def resume(run_dir: Path, *overrides: str, steps: int = 4) -> list[float]:
    """Continue a run (as `dllm launch` does in its one worker) to `steps`."""
    spec, _ = resolve_run_spec(load_spec(run_dir.parent.parent / "train.yaml", f"training.steps={steps}", *overrides))
    return train_from_run_dir(prepare_run_dir(spec))


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """Run `dllm ARGS` in this process: (exit code, stderr lines)."""
    capsys.readouterr()
    code = main(args)
    return code, capsys.readouterr().err.splitlines()
