"""Start training: one in-process worker, or `torch.distributed.run` with N workers per node.

The worker tree ends with the launcher. torchrun starts every worker in a session of its own, so no
signal sent to the launcher or its process group reaches them, and nothing at all tells them when the
launcher is SIGKILLed. So the launcher gives torchrun a pipe as stdin, which every worker inherits,
and keeps the only write end: however the launcher ends, the kernel closes that end, and a watchdog
thread in each worker (`watch_launcher`, started by `--watch-stdin`) reads end of file and ends the
worker. SIGINT and SIGTERM of the launcher close the pipe on purpose and wait for torchrun to go.
torchrun runs in a session of its own, so a Ctrl-C in the terminal reaches the launcher alone and
the stop goes through this one path.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from types import FrameType

from dllm.config.training import TopologyConfig

WATCH_STDIN = "--watch-stdin"
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(BaseException):
    """The launcher was asked to stop (SIGINT or SIGTERM); like KeyboardInterrupt, no `except
    Exception` in the training code swallows it."""

    def __init__(self, signum: int) -> None:
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum  # what a shell reports for a process ended by that signal
        super().__init__(self.signal_name)


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
    return [*cmd, "-m", "dllm.training.worker", WATCH_STDIN, str(spec_path)]


def format_command(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Raise `Stopped` on SIGINT or SIGTERM while the block runs: Python's default SIGTERM ends the
    process at once, without a word and before it can stop its workers."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def run_command(cmd: list[str], keep_fds: tuple[int, ...] = (), grace_s: float = 20.0) -> int:
    """Run torchrun and pass its exit code through; its workers end with this process (see the module
    docstring). `keep_fds` are inherited by torchrun (the run-folder lock: it stays held until
    torchrun has reaped its workers, even when this process is killed). On `Stopped` the tree is
    ended (closing the pipe, then SIGTERM and SIGKILL to torchrun after `grace_s` each) and the
    exception goes on."""
    read_end, write_end = os.pipe()  # both ends close-on-exec; Popen hands read_end over as stdin
    try:
        proc = subprocess.Popen(cmd, stdin=read_end, pass_fds=keep_fds, start_new_session=True)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        return proc.wait()
    except Stopped:
        for s in _STOP_SIGNALS:  # a second Ctrl-C must not cut the shutdown short
            signal.signal(s, signal.SIG_IGN)
        os.close(write_end)
        write_end = -1
        _end(proc, grace_s)
        raise
    finally:
        if write_end >= 0:
            os.close(write_end)  # workers left behind by a torchrun that died see end of file


def _end(proc: subprocess.Popen, grace_s: float) -> None:
    """Wait for torchrun to exit after its workers did; then ask it (SIGTERM), then force it (SIGKILL)."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)  # torchrun leads its own session: its group is its pid
        try:
            proc.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def watch_launcher(announce: bool) -> threading.Thread:
    """In a worker started by `run_command`: end this process as soon as stdin reaches end of file,
    which happens when the launcher is gone (killed, stopped, or crashed). Exits with status 0 so
    that torchrun, which nobody is reading any more, winds down without printing a failure report."""

    def watch() -> None:
        while True:
            try:
                data = os.read(0, 4096)
            except OSError:
                return  # no stdin to watch: run unwatched, as a worker started by hand does
            if not data:
                break
        if announce:
            print("dllm: the launcher has stopped: ending the workers", file=sys.stderr, flush=True)
        os._exit(0)

    thread = threading.Thread(target=watch, name="dllm-launcher-watch", daemon=True)
    thread.start()
    return thread
