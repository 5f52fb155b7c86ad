"""Training through `dllm launch` with tensor parallelism: DP2 x TP2 (sequence parallel) follows the
one-process run step for step, and checkpoints reshard across topologies (DCP): DP4 -> DP2 x TP2 ->
one process, each resumed step equal to the uninterrupted run's; `dllm convert --to-hf` of a
tensor-parallel run's checkpoint writes the full weights (those of the one-process run, up to the
summation order of six steps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from dllm.training.metrics import read_metrics
from tests.helpers import tiny_train_values, write_yaml

pytestmark = pytest.mark.distributed

TP2 = ["--set", "topology.tp_size=2", "--set", "topology.sequence_parallel=true"]


def _dllm(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dllm.cli.main", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def _launch(cwd: Path, name: str, nproc: int, *extra: str) -> list[dict]:
    args = ["launch", "--config", "train.yaml", "--nproc-per-node", str(nproc), "--set", f"run.name={name}"]
    res = _dllm([*args, *extra], cwd)
    assert res.returncode == 0, res.stderr[-3000:]
    return read_metrics(cwd / "runs" / name)


@pytest.fixture
def tp_yaml(workdir: Path) -> Path:
    # a constant LR: a run stopped at step k and continued follows the uninterrupted schedule
    values = tiny_train_values(training={"steps": 6, "micro_batch_size": 2}, scheduler={"name": "constant"})
    return write_yaml(workdir / "train.yaml", values)


def test_tensor_parallel_training_and_resharded_resume(tp_yaml: Path):
    cwd = tp_yaml.parent
    one = _launch(cwd, "one", 1)
    assert [r["step"] for r in one] == [1, 2, 3, 4, 5, 6]

    # DP2 x TP2 (sequence parallel) from scratch: every step's loss and gradient norm
    tp = _launch(cwd, "tp", 4, *TP2)
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    assert [r["grad_norm"] for r in tp] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)

    # one run folder, three topologies: DP4 for steps 1-2, DP2 x TP2 for 3-4, one process for 5-6
    first = _launch(cwd, "mix", 4, "--set", "training.steps=2")
    second = _launch(cwd, "mix", 4, "--set", "training.steps=4", *TP2)
    third = _launch(cwd, "mix", 1)
    losses = {r["step"]: r["loss"] for r in [*first, *second, *third]}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert [losses[s] for s in range(1, 7)] == pytest.approx([r["loss"] for r in one], rel=1e-5)

    # `convert --to-hf` of the checkpoint the DP2 x TP2 run wrote: full tensors, the one-process run's
    exported = {}
    for name in ("one", "tp"):
        res = _dllm(["convert", "--to-hf", f"hf-{name}", "--run", f"runs/{name}"], cwd)
        assert res.returncode == 0, res.stderr[-3000:]
        exported[name] = load_file(cwd / f"hf-{name}" / "model.safetensors")
    assert exported["tp"].keys() == exported["one"].keys()
    for key, ref in exported["one"].items():
        got = exported["tp"][key]
        assert got.shape == ref.shape and got.dtype == ref.dtype, key
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-4, key  # measured: <= 3e-5
