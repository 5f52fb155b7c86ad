"""`training.activation_checkpointing` end to end: a `dllm launch` run (one process) with full
checkpointing logs the same losses, bit for bit, as the run without it (selective: the unit tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dllm.config.loading import load_config
from dllm.config.spec import RunSpec
from dllm.parallel.apply import unwrap
from dllm.parallel.checkpointing import checkpointing_mode
from dllm.training.build import build_trainer
from dllm.training.metrics import read_metrics
from tests.helpers import tiny_train_values, write_yaml


def _launch(cwd: Path, *overrides: str) -> list[float]:
    args = [sys.executable, "-m", "dllm.cli.main", "launch", "--config", "train.yaml"]
    args += [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    name = next(o.split("=", 1)[1] for o in overrides if o.startswith("run.name="))
    return [r["loss"] for r in read_metrics(cwd / "runs" / name)]


def test_checkpointed_runs_log_the_same_losses(workdir: Path):
    values = tiny_train_values(training={"steps": 3}, checkpointing={"every_steps": None, "save_final": False})
    write_yaml(workdir / "train.yaml", values)
    plain = _launch(workdir, "run.name=none")
    full = _launch(workdir, "run.name=full", "training.activation_checkpointing=full")
    assert len(plain) == 3
    assert full == plain
    # the run's own config builds a checkpointed model (the equal losses alone would not show it)
    spec = load_config(RunSpec, workdir / "runs" / "full" / "config.yaml")
    trainer = build_trainer(spec, workdir / "runs" / "full")
    try:
        assert checkpointing_mode(unwrap(trainer.model)) == "full"
    finally:
        trainer.metrics.close()
