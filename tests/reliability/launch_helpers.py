"""Start `dllm launch` as a user does, and find the processes of a run (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

needs_proc = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")

SMALL = {"logging": {"every_steps": 1, "progress": "off", "tensorboard": "off"}}


def start_launch(cwd: Path, *args: str) -> subprocess.Popen:
    """`dllm launch --config train.yaml ARGS` in the background; stderr is captured."""
    cmd = [sys.executable, "-m", "dllm.cli.main", "launch", "--config", "train.yaml", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(condition: Callable[[], bool], timeout_s: float, every_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every_s)
    return condition()


def live_pids(folder: Path) -> list[int]:
    """Processes (zombies aside) working in `folder`: a launcher started there and everything it
    starts, torchrun and the workers, including a child forked but not yet turned into torchrun."""
    folder = folder.resolve()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = (entry / "cwd").resolve(strict=True)
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cwd == folder and state != "Z":
            found.append(int(entry.name))
    return found


def kill_leftovers(folder: Path) -> None:
    """Clean up after a failed test: SIGKILL the processes this test started (they work in its tmp folder)."""
    for pid in live_pids(folder):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
