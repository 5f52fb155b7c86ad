"""Training through `dllm launch` with tensor parallelism: checkpoints reshard across topologies (DCP):
DP2 (FSDP) -> TP2 (sequence parallel) -> one process, each step's loss equal to the uninterrupted
one-process run's and the tensor-parallel steps' gradient norms too; `dllm convert --to-hf` of the
tensor-parallel segment's checkpoint writes the full weights (those of the one-process run, up to the
summation order of four steps)."""

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

    # one run folder, three topologies: DP2 (FSDP shards) for steps 1-2, TP2 (sequence parallel) for 3-4, one
    # process for 5-6; every step's loss (and the tensor-parallel steps' gradient norms) as uninterrupted.
    # (DP x TP on 4 processes is tests/distributed/test_tensor_parallel.py's; 2 processes keep this one short.)
    first = _launch(cwd, "mix", 2, "--set", "training.steps=2")
    second = _launch(cwd, "mix", 2, "--set", "training.steps=4", *TP2)
    third = _launch(cwd, "mix", 1)
    losses = {r["step"]: r["loss"] for r in [*first, *second, *third]}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert [losses[s] for s in range(1, 7)] == pytest.approx([r["loss"] for r in one], rel=1e-5)
    tp_norms = [r["grad_norm"] for r in second if r["step"] in (3, 4)]  # metrics.jsonl holds the run's every segment
    assert tp_norms == pytest.approx([r["grad_norm"] for r in one[2:4]], rel=1e-4)

    # `convert --to-hf` of the step-4 checkpoint the TP2 segment wrote: full tensors, the one-process run's
    exported = {}
    for name in ("one", "mix"):
        ckpt = f"runs/{name}/checkpoints/step_00000004"
        res = _dllm(["convert", "--to-hf", f"hf-{name}", "--checkpoint", ckpt], cwd)
        assert res.returncode == 0, res.stderr[-3000:]
        exported[name] = load_file(cwd / f"hf-{name}" / "model.safetensors")
    assert exported["mix"].keys() == exported["one"].keys()
    for key, ref in exported["one"].items():
        got = exported["mix"][key]
        assert got.shape == ref.shape and got.dtype == ref.dtype, key
        assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-4, key  # measured: <= 3e-5
