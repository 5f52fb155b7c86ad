"""Start training: one in-process worker, or `torch.distributed.run` with N workers per node."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

from dllm.config.training import TopologyConfig


def worker_command(
    spec_path: Path, topo: TopologyConfig, rdzv_endpoint: str | None, node_rank: int | None
) -> list[str]:
    """The exact torchrun command for a resolved spec file."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={topo.nproc_per_node}"]
    if topo.nnodes > 1:
        cmd += [f"--nnodes={topo.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            cmd += [f"--node-rank={node_rank}"]
    else:
        cmd += ["--standalone"]
    return [*cmd, "-m", "dllm.training.worker", str(spec_path)]


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


def run_command(cmd: list[str]) -> int:
    """Run torchrun and pass its exit code through (Ctrl-C stops the workers)."""
    proc = subprocess.Popen(cmd)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()
