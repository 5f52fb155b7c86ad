"""Start training: one in-process worker, or `torch.distributed.run` with N workers per node.

The worker tree ends with the launcher. torchrun starts every worker in a session of its own, so no
signal sent to the launcher or its process group reaches them, and nothing at all tells them when the
launcher is SIGKILLed. So the launcher gives torchrun a pipe as stdin, which every worker inherits,
and keeps the only write end: however the launcher ends, the kernel closes that end, and a watchdog
thread in each worker (`watch_launcher`, started by `--watch-stdin`) reads end of file and ends the
worker. SIGINT and SIGTERM of the launcher close the pipe on purpose and wait for torchrun to go.
torchrun runs in a session of its own, so a Ctrl-C in the terminal reaches the launcher alone and
the stop goes through this one path.

Several nodes: one launcher per node, each with its own pipe and workers. The workers of a node
that stops alone exit 0, and its torchrun then waits in its exit barrier for agents that will not
come (SIGTERM does not reach it there), so `_end` ends it with SIGKILL after two grace periods; the
other nodes' workers fail at their next collective and their launchers exit non-zero.
"""

from __future__ import annotations

import os
import re
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
from dllm.errors import ConfigError

WATCH_STDIN = "--watch-stdin"
CONFIG_SHA256 = "--config-sha256="
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_HOST = re.compile(r"[A-Za-z0-9_.:-]+")  # a host name, an IPv4 address, or an IPv6 one (its brackets removed)


class Stopped(BaseException):
    """The launcher was asked to stop (SIGINT or SIGTERM); like KeyboardInterrupt, no `except
    Exception` in the training code swallows it."""

    def __init__(self, signum: int) -> None:
        self.signal_name = signal.Signals(signum).name
        self.exit_code = 128 + signum  # what a shell reports for a process ended by that signal
        super().__init__(self.signal_name)


def check_nodes(nnodes: int, node_rank: int | None, rdzv_endpoint: str | None) -> list[str]:
    """One-line ConfigErrors for a multi-node launch without its node rank or rendezvous endpoint, or
    with one out of range or malformed; warnings for those flags on a single node, where they do nothing."""
    if nnodes == 1:
        given = [f for f, v in (("--node-rank", node_rank), ("--rdzv-endpoint", rdzv_endpoint)) if v is not None]
        return [f"{f} has no effect with topology.nnodes 1" for f in given]
    if node_rank is None:
        raise ConfigError(
            f"--node-rank is needed when topology.nnodes is {nnodes}: give each machine its own, 0 to {nnodes - 1} "
            "(0 on the machine named by --rdzv-endpoint)"
        )
    if node_rank >= nnodes:
        raise ConfigError(
            f"--node-rank {node_rank} is out of range for topology.nnodes {nnodes}: use 0 to {nnodes - 1}"
        )
    if not rdzv_endpoint:
        raise ConfigError(
            "--rdzv-endpoint HOST:PORT is needed when topology.nnodes > 1 (the host of node rank 0 and a free port)"
        )
    parse_endpoint(rdzv_endpoint)
    return []


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port), or a one-line ConfigError."""
    host, sep, port = endpoint.rpartition(":")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not _HOST.fullmatch(bare) or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT (the host name or IP address of node rank 0, "
            "and a free port 1-65535, e.g. node0:29500)"
        )
    return bare, int(port)


def worker_command(
    spec_path: Path,
    topo: TopologyConfig,
    rdzv_endpoint: str | None = None,
    node_rank: int | None = None,
    config_sha256: str | None = None,
) -> list[str]:
    """The exact torchrun command for a resolved spec file. Several nodes meet at a static rendezvous:
    node rank 0 hosts the TCP store at `rdzv_endpoint` (so that must be its address) and node rank R
    holds world ranks R x nproc_per_node onwards, in the order --node-rank gives. (torchrun's c10d
    rendezvous ignores --node-rank, orders the nodes by host name and guesses which one hosts the
    store from the endpoint's name, which two nodes on one host both match.) Their workers check the
    shared config against `config_sha256`, the digest of what this node's launch resolved."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={topo.nproc_per_node}"]
    worker = [WATCH_STDIN]
    if topo.nnodes > 1:
        assert rdzv_endpoint is not None and node_rank is not None, "check_nodes comes first"
        cmd += [f"--nnodes={topo.nnodes}", "--rdzv-backend=static", f"--rdzv-endpoint={rdzv_endpoint}"]
        cmd += [f"--node-rank={node_rank}"]
        if config_sha256 is not None:
            worker += [f"{CONFIG_SHA256}{config_sha256}"]
    else:
        cmd += ["--standalone"]
    return [*cmd, "-m", "dllm.training.worker", *worker, str(spec_path)]


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


def run_command(
    cmd: list[str], keep_fds: tuple[int, ...] = (), grace_s: float = 20.0, env: dict[str, str] | None = None
) -> int:
    """Run torchrun and pass its exit code through; its workers end with this process (see the module
    docstring). `keep_fds` are inherited by torchrun (the run-folder lock: it stays held until
    torchrun has reaped its workers, even when this process is killed). On `Stopped` the tree is
    ended (closing the pipe, then SIGTERM and SIGKILL to torchrun after `grace_s` each) and the
    exception goes on. `env`: the workers' environment (None: this process's)."""
    read_end, write_end = os.pipe()  # both ends close-on-exec; Popen hands read_end over as stdin
    try:
        proc = subprocess.Popen(cmd, stdin=read_end, pass_fds=keep_fds, start_new_session=True, env=env)
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
