"""Multi-node launch, as two "nodes" on this machine: two `dllm launch` processes (2 workers each,
node ranks 0 and 1, a static rendezvous on 127.0.0.1) share one run folder, as the nodes of a
cluster share a filesystem. They train the losses of one node with 4 workers, write one config,
one metrics log and a checkpoint that loads into the same weights; the flags of a multi-node launch
are checked with one-line errors before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dllm.checkpoint.files import verify_checkpoint
from dllm.checkpoint.loading import load_for_inference
from dllm.checkpoint.manager import latest_checkpoint, read_trainer_state
from dllm.cli.main import main
from dllm.training.metrics import read_metrics
from dllm.training.run_lock import lock_run_dir
from tests.distributed.harness import free_port
from tests.helpers import tiny_train_values, write_yaml
from tests.reliability.launch_helpers import kill_leftovers

STEPS = 10
# 4 ranks x 2 sequences = the global batch of 8: one micro-batch per rank and step
TRAIN = tiny_train_values(
    training={"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2}, checkpointing={"every_steps": 5}
)


def _start(cwd: Path, log: Path, *args: str) -> subprocess.Popen:
    """`dllm launch --config train.yaml ARGS` in the background, its output in `log` (a file, not a
    pipe: two nodes block each other if one of them fills a pipe nobody reads)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as fh:
        cmd = [sys.executable, "-m", "dllm.cli.main", "launch", "--config", "train.yaml", *args]
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT)


def _two_nodes(cwd: Path, name: str, nproc: int, node_args: tuple[list[str], list[str]] = ([], [])) -> list[int]:
    """Start node ranks 0 and 1 of a 2 x NPROC run at once; their exit codes (logs in cwd/NAME.nodeR.log)."""
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    common += ["--set", f"run.name={name}"]
    procs = [
        _start(cwd, cwd / f"{name}.node{rank}.log", *common, "--node-rank", str(rank), *node_args[rank])
        for rank in (0, 1)
    ]
    try:
        return [p.wait(timeout=240) for p in procs]
    finally:
        kill_leftovers(cwd)  # after a timeout: neither node's workers outlive the test


def _log(cwd: Path, name: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(cwd.glob(f"{name}*.log")))


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_of_two_train_as_one_node_of_four(workdir: Path):
    write_yaml(workdir / "train.yaml", TRAIN)
    codes = _two_nodes(workdir, "two", 2)
    assert codes == [0, 0], _log(workdir, "two")
    one = _start(workdir, workdir / "one.log", "--nproc-per-node", "4", "--set", "run.name=one")
    assert one.wait(timeout=240) == 0, _log(workdir, "one")

    two_dir, one_dir = workdir / "runs" / "two", workdir / "runs" / "one"
    node0, node1 = ((workdir / f"two.node{r}.log").read_text() for r in (0, 1))
    assert "--rdzv-backend=static" in node1 and "--node-rank=1" in node1
    # one metrics row per step, from global rank 0 alone; the same losses as one node of 4 workers
    assert [r["step"] for r in read_metrics(two_dir)] == list(range(1, STEPS + 1))
    two, ref = _losses(two_dir), _losses(one_dir)
    assert len(ref) == STEPS and two == pytest.approx(ref, rel=1e-6, abs=0)
    # node rank 0 wrote the shared files; each node held its own lock and removed it at the end
    assert sorted(p.name for p in two_dir.iterdir()) == [
        "checkpoints", "config.yaml", "metrics.jsonl",
    ]  # fmt: skip

    ckpt = latest_checkpoint(two_dir / "checkpoints")
    assert ckpt is not None and ckpt.name == f"step_{STEPS:08d}" and read_trainer_state(ckpt)["step"] == STEPS
    verify_checkpoint(ckpt, hashes=True)  # every file the manifest lists, written by both nodes
    ref_ckpt = latest_checkpoint(one_dir / "checkpoints")
    assert ref_ckpt is not None
    shards = sorted(p.name for p in ckpt.glob("*.distcp"))
    assert shards == sorted(p.name for p in ref_ckpt.glob("*.distcp")) and len(shards) == 4
    weights = load_for_inference(run=two_dir).model.state_dict()
    ref_weights = load_for_inference(run=one_dir).model.state_dict()
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)
    assert "error" not in node0 + node1


@pytest.mark.slow
@pytest.mark.distributed
def test_a_node_started_with_another_config_stops_every_node(workdir: Path):
    """Node rank 0 writes config.yaml and every node's workers read it: a node whose own launch
    resolved something else says so instead of training node rank 0's config."""
    write_yaml(workdir / "train.yaml", tiny_train_values())
    codes = _two_nodes(workdir, "mix", 1, ([], ["--set", "training.steps=5"]))
    assert codes[0] != 0 and codes[1] != 0, _log(workdir, "mix")
    node0, node1 = ((workdir / f"mix.node{r}.log").read_text() for r in (0, 1))
    config = workdir / "runs" / "mix" / "config.yaml"
    assert f"dllm: error: {config} (written by node rank 0) differs from what this node's launch resolved" in node1
    assert "differs from what another node's launch resolved" in node0
    assert not (workdir / "runs" / "mix" / "metrics.jsonl").exists() or not read_metrics(workdir / "runs" / "mix")


def _launch_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The one line a launch with ARGS fails with (exit code 2)."""
    code = main(["launch", "--config", "train.yaml", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("dllm: error: ")
    return err.removeprefix("dllm: error: ")


TWO_NODES = ["--nnodes", "2", "--nproc-per-node", "1"]


def test_a_multi_node_launch_needs_its_node_rank(
    train_yaml: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(train_yaml.parent)
    err = _launch_error(capsys, *TWO_NODES, "--rdzv-endpoint", "node0:29500")
    assert err.startswith("--node-rank is needed when topology.nnodes is 2: give each machine its own, 0 to 1")
    err = _launch_error(capsys, *TWO_NODES, "--rdzv-endpoint", "node0:29500", "--node-rank", "2")
    assert err == "--node-rank 2 is out of range for topology.nnodes 2: use 0 to 1"
    err = _launch_error(capsys, *TWO_NODES, "--node-rank", "0")
    assert err.startswith("--rdzv-endpoint HOST:PORT is needed when topology.nnodes > 1")
    assert not (train_yaml.parent / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize("endpoint", ["node0", "node0:", ":29500", "node0:http", "node0:0", "node0:65536", "a b:1"])
def test_a_malformed_rendezvous_endpoint_is_one_line(
    train_yaml: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, endpoint: str
):
    monkeypatch.chdir(train_yaml.parent)
    err = _launch_error(capsys, *TWO_NODES, "--node-rank", "0", "--rdzv-endpoint", endpoint)
    assert err.startswith(f"--rdzv-endpoint {endpoint!r} is not HOST:PORT")


def test_the_dry_run_of_a_node_prints_its_static_rendezvous(
    train_yaml: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(train_yaml.parent)
    args = [*TWO_NODES, "--node-rank", "1", "--rdzv-endpoint", "[fe80::1]:29500", "--dry-run"]
    assert main(["launch", "--config", "train.yaml", *args]) == 0
    cmd = capsys.readouterr().out
    assert "--nnodes=2 --rdzv-backend=static '--rdzv-endpoint=[fe80::1]:29500' --node-rank=1" in cmd
    assert "--config-sha256=" in cmd


def test_node_flags_on_one_node_are_a_warning(
    train_yaml: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(train_yaml.parent)
    args = ["--nproc-per-node", "2", "--node-rank", "1", "--rdzv-endpoint", "node0:29500", "--dry-run"]
    assert main(["launch", "--config", "train.yaml", *args]) == 0
    res = capsys.readouterr()
    assert "--standalone" in res.out and "--node-rank" not in res.out and "--config-sha256" not in res.out
    assert "--node-rank has no effect with topology.nnodes 1" in res.err
    assert "--rdzv-endpoint has no effect with topology.nnodes 1" in res.err
    assert "is written at launch" in res.err  # by this launch: with one node, its rank is 0


def test_two_launches_of_one_node_rank_are_refused(
    train_yaml: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    """Node ranks 0 and 1 lock the shared folder side by side; a second node rank 1 is refused."""
    monkeypatch.chdir(train_yaml.parent)
    run_dir = train_yaml.parent / "runs" / "t"
    held = [lock_run_dir(run_dir, 0), lock_run_dir(run_dir, 1)]
    try:
        args = [*TWO_NODES, "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:29500"]
        err = _launch_error(capsys, *args)
    finally:
        for lock in held:
            lock.release()
    assert err.startswith(f"{run_dir} is in use by another dllm launch of node rank 1 (host ")
    assert f"pid {os.getpid()}," in err
