"""Two gloo processes (FSDP2 and DDP) reproduce the one-process loss on the same global batch,
and a checkpoint written by two processes resumes in one (resharding)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dllm.training.metrics import read_metrics
from tests.helpers import tiny_train_values, write_yaml

pytestmark = pytest.mark.distributed


def _dllm(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "dllm.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture
def dp_yaml(workdir: Path) -> Path:
    return write_yaml(workdir / "train.yaml", tiny_train_values(training={"steps": 4}))


@pytest.mark.parametrize(
    ("mode", "objective"), [("fsdp", "mdlm"), ("ddp", "mdlm"), ("fsdp", "bd3lm"), ("fsdp", "mdlm+compile")]
)
def test_two_processes_match_one(dp_yaml: Path, mode: str, objective: str):
    """mdlm+compile: compiled blocks under FSDP2 on two ranks against the eager single process."""
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import load_spec

    extra = ["objective.name=bd3lm", "objective.block_size=8"] if objective == "bd3lm" else []
    spec, _ = resolve_run_spec(load_spec(dp_yaml, "run.name=one", *extra))
    one = train_from_run_dir(prepare_run_dir(spec))
    args = ["launch", "--config", "train.yaml", "--nproc-per-node", "2", "--set", f"topology.data_parallel={mode}"]
    if objective == "mdlm+compile":
        args += ["--set", "training.compile=true"]
    args += ["--set", "run.name=two", *[a for o in extra for a in ("--set", o)]]
    res = _dllm(args, dp_yaml.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    two = _losses(dp_yaml.parent / "runs" / "two")
    assert len(two) == len(one) == 4
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)


def test_two_process_checkpoint_resumes_in_one(dp_yaml: Path):
    """Save with FSDP2 on 2 ranks at step 2, then continue in 1 process: DCP reshards."""
    cwd = dp_yaml.parent
    # a constant LR, so that stopping at step 2 and going on to 4 follows the reference's schedule
    const = ["--set", "scheduler.name=constant"]
    ref = _dllm(["launch", "--config", "train.yaml", "--set", "run.name=ref", *const], cwd)
    assert ref.returncode == 0, ref.stderr[-2000:]
    part = _dllm(
        [
            "launch",
            "--config",
            "train.yaml",
            "--nproc-per-node",
            "2",
            "--set",
            "run.name=mix",
            "--set",
            "training.steps=2",
            *const,
        ],
        cwd,
    )
    assert part.returncode == 0, part.stderr[-2000:]
    rest = _dllm(["launch", "--config", "train.yaml", "--set", "run.name=mix", *const], cwd)
    assert rest.returncode == 0, rest.stderr[-2000:]
    assert _losses(cwd / "runs" / "mix")[2:] == pytest.approx(_losses(cwd / "runs" / "ref")[2:], rel=1e-5)


def test_fsdp_with_full_activation_checkpointing_matches_one(dp_yaml: Path):
    """FSDP2 shards blocks whose forward is checkpointed (apply.py: checkpointing, then fully_shard):
    the recompute in the backward runs on the re-gathered parameters, and the losses are the
    one-process run's without checkpointing."""
    from dllm.training.preflight import resolve_run_spec
    from dllm.training.run import prepare_run_dir, train_from_run_dir
    from tests.helpers import load_spec

    spec, _ = resolve_run_spec(load_spec(dp_yaml, "run.name=one", "training.steps=3"))
    one = train_from_run_dir(prepare_run_dir(spec))
    args = ["launch", "--config", "train.yaml", "--nproc-per-node", "2", "--set", "topology.data_parallel=fsdp"]
    args += ["--set", "run.name=two", "--set", "training.steps=3", "--set", "training.activation_checkpointing=full"]
    res = _dllm(args, dp_yaml.parent)
    assert res.returncode == 0, res.stderr[-2000:]
    two = _losses(dp_yaml.parent / "runs" / "two")
    assert len(two) == len(one) == 3
    assert two == pytest.approx(one, rel=1e-5, abs=1e-6)
