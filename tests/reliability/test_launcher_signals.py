"""Reliability hardening, signals: the workers end with `dllm launch`. SIGKILL of the launcher used to leave
torchrun and both workers training (and publishing checkpoints); SIGTERM ended the launcher alone,
without a word. After a stop the launcher lingered once its workers had ended (3 s on two idle cores,
~15 s on a busy machine), most of it Python collecting torch's objects one by one at exit."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dllm.training.metrics import read_metrics
from tests.helpers import tiny_train_values, write_yaml
from tests.reliability.launch_helpers import SMALL, kill_leftovers, live_pids, needs_proc, start_launch, wait_for

LONG = {**SMALL, "training": {"steps": 100_000}, "checkpointing": {"every_steps": 5}}


def _long_run(workdir: Path) -> Path:
    write_yaml(workdir / "train.yaml", tiny_train_values(**LONG))
    return workdir / "runs" / "t"


def _logged(run_dir: Path, n: int) -> bool:
    return len(read_metrics(run_dir)) >= n


@needs_proc
@pytest.mark.distributed
@pytest.mark.slow  # 8-20 s: two workers start on a shared 2-core machine
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_two_workers_end_with_their_launcher(workdir: Path, sig: signal.Signals):
    run_dir = _long_run(workdir)
    proc = start_launch(workdir, "--nproc-per-node", "2")
    try:
        assert wait_for(lambda: _logged(run_dir, 3), 90), "the workers did not start training"
        assert len(live_pids(workdir)) == 4  # the launcher, torchrun and two workers
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert wait_for(lambda: not live_pids(workdir), 10), f"alive after the launcher got {sig.name}"
        seen = len(read_metrics(run_dir))
        assert not wait_for(lambda: _logged(run_dir, seen + 1), 1.0), "training went on"
    finally:
        kill_leftovers(workdir)
        proc.kill()
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM
        assert err.strip().splitlines()[-1].startswith("dllm: stopped by SIGTERM: all training processes have ended")
        assert "Traceback" not in err


def _is_worker(pid: int) -> bool:
    cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    return b"dllm.training.worker\0" in cmd and b"torch.distributed.run" not in cmd


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@needs_proc
@pytest.mark.distributed
@pytest.mark.slow  # 8-20 s: two workers start on a shared 2-core machine
def test_the_launcher_exits_promptly_once_its_workers_have_ended(workdir: Path):
    run_dir = _long_run(workdir)
    proc = start_launch(workdir, "--nproc-per-node", "2")
    try:
        assert wait_for(lambda: _logged(run_dir, 3), 90), "the workers did not start training"
        workers = [p for p in live_pids(workdir) if _is_worker(p)]
        assert len(workers) == 2
        proc.send_signal(signal.SIGINT)
        assert wait_for(lambda: not any(_alive(p) for p in workers), 30, every_s=0.01), "the workers went on"
        ended = time.monotonic()
        proc.wait(timeout=60)
        lingered_s = time.monotonic() - ended
    finally:
        kill_leftovers(workdir)
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert lingered_s < 8.0, f"the launcher lingered {lingered_s:.1f} s after its workers had ended"


def test_the_command_skips_collecting_its_objects_at_exit():
    """The command done, its objects are frozen (gc.freeze) so that Python's collection at exit skips them:
    it took 1-2 s on two idle cores after every `dllm launch` (torch imported), and far more on a busy box."""
    code = (
        "import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
        "sys.argv = ['dllm', '--help']; from dllm.cli.main import entry; entry()"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1] == "frozen True", (res.stdout, res.stderr)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_one_process_run_stops_with_a_last_word(workdir: Path, sig: signal.Signals):
    run_dir = _long_run(workdir)
    proc = start_launch(workdir)
    try:
        assert wait_for(lambda: _logged(run_dir, 6), 60), "no checkpoint yet"  # one every 5 steps
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"dllm: stopped by {sig.name}: ") and "resumes from" in last, err[-2000:]
    assert "Traceback" not in err


def test_a_worker_ends_when_its_launcher_is_gone():
    """The watchdog a worker starts with --watch-stdin: end of file on stdin ends the process."""
    code = "import time; from dllm.parallel.launch import watch_launcher; watch_launcher(True); time.sleep(60)"
    read_end, write_end = os.pipe()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=read_end, stderr=subprocess.PIPE, text=True)
    os.close(read_end)
    try:
        assert not wait_for(lambda: proc.poll() is not None, 2.0)  # an open pipe: the worker goes on
        os.close(write_end)  # what the kernel does when the launcher dies
        _, err = proc.communicate(timeout=15)
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert "the launcher has stopped" in err


def test_a_stop_during_a_checkpoint_save_stays_a_stop():
    """DCP wraps whatever a save step raises, KeyboardInterrupt included, into a CheckpointException: a
    SIGTERM that lands inside the save must still end the run as a stop (exit 128 + signal), not as a
    failed save with a traceback."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from dllm.checkpoint.manager import _interruption
    from dllm.parallel.launch import Stopped

    stop = Stopped(signal.SIGTERM)
    wrapped = CheckpointException("save failed", {0: _wrap_exception(stop)})
    assert _interruption(wrapped) is stop and _interruption(stop) is stop
    assert _interruption(CheckpointException("x", {0: _wrap_exception(OSError(28, "full"))})) is None
    assert _interruption(ValueError("bad")) is None
    # the stop lands inside torch.save's zip writer, whose exit then fails on the half-written file
    # (seen in CI: "unexpected pos 64 vs 0"): the writer's error carries the stop as its context
    try:
        try:
            raise stop
        finally:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
    except RuntimeError as writer_error:
        mid_write = writer_error
    assert _interruption(CheckpointException("save failed", {0: _wrap_exception(mid_write)})) is stop
    unrelated = RuntimeError("disk")
    unrelated.__context__ = ValueError("earlier")
    assert _interruption(unrelated) is None
