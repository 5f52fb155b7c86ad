"""One launch per run folder: an exclusive `flock` on RUN_DIR/run.lock, which names its holder.

The launcher takes it, not rank 0: the launcher writes the run folder before any worker exists
(config.yaml, the `latest` link, old checkpoints moved aside for `resume: never`), and every worker
ends with the launcher (dllm.parallel.launch). torchrun inherits the descriptor, so the lock stays
held until torchrun has reaped its workers even when the launcher is SIGKILLed. The kernel releases
a flock when the last process holding it exits, so a lock left by a dead launch is simply taken
over. A launch that ends normally (torchrun and its workers gone) removes the file while it still
holds the lock; a taker that opened the file just before that, and then locks a removed file, sees
that the path no longer names what it locked and takes the new file instead.

Multi-node runs lock one file per node rank: the nodes of one run share the folder (a shared
filesystem), where one file would lock out every node but the first. Node rank 0 writes the run
folder's shared files, as a single-node launch does, so it takes run.lock and refuses a concurrent
single-node launch; node rank R > 0 takes run.nodeR.lock, so a second launch of the same node rank
is refused wherever it starts (two "nodes" on one host included) while the other ranks can join.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from dllm.errors import CheckpointError

LOCK_NAME = "run.lock"


@dataclass
class RunLock:
    path: Path
    fd: int

    def release(self, remove: bool = False) -> None:
        """Release the lock; `remove` also deletes the file (only when no other process still holds the
        descriptor: torchrun inherits it, so only after a normal end)."""
        if self.fd < 0:
            return
        if remove:
            self.path.unlink(missing_ok=True)  # still held: a taker that opened it retries (`_same_file`)
        os.close(self.fd)  # closing the last descriptor of the open file releases the flock
        self.fd = -1


def lock_name(node_rank: int = 0) -> str:
    return LOCK_NAME if node_rank == 0 else f"run.node{node_rank}.lock"


def lock_run_dir(run_dir: Path, node_rank: int = 0) -> RunLock:
    """Take the run folder's lock (of one node of a multi-node run) or raise a one-line
    CheckpointError naming the holder."""
    path = run_dir / lock_name(node_rank)
    for _ in range(_ATTEMPTS):
        fd = _open(path)
        _flock(fd, path, run_dir, node_rank)
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder ended and removed it after we opened it: lock the file now at `path`
    else:
        raise CheckpointError(f"{path}: keeps being removed and recreated by other launches; try again")
    os.ftruncate(fd, 0)
    stamp = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.pwrite(fd, (json.dumps(stamp) + "\n").encode(), 0)
    return RunLock(path, fd)


_ATTEMPTS = 10


def _open(path: Path) -> int:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot create the run lock ({e.strerror}); check run.output_dir") from None


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the open file `fd` (not removed, nor replaced by a new one)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _flock(fd: int, path: Path, run_dir: Path, node_rank: int) -> None:
    """Lock `fd` without waiting, or close it and raise the one-line refusal naming the holder."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise CheckpointError(
                f"{run_dir} is in use by another dllm launch{_of_node(node_rank)} ({holder}); wait for it to end "
                "or stop it, or choose another run.name"
            ) from None
        raise CheckpointError(
            f"{path}: cannot lock the run folder ({e.strerror}); put run.output_dir on a filesystem with "
            "file locks (a local disk, or for several nodes a shared one that supports flock)"
        ) from None


def _of_node(node_rank: int) -> str:
    return f" of node rank {node_rank}" if node_rank else ""


def _holder(fd: int) -> str:
    """'host H, pid P, since T' from the lock file (the holder may not have written it yet)."""
    try:
        stamp = json.loads(os.pread(fd, 4096, 0).decode())
        return f"host {stamp['host']}, pid {stamp['pid']}, since {stamp['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "holder not recorded yet"
