"""Reliability hardening, the run lock: one launch per run folder. Two launches into one run used to race (a traceback
from pruning, metrics.jsonl cut, a stray step_N.tmp); now the second one gets one line naming the
holder, and a lock left by a dead launch is taken over. A launch that ends normally removes run.lock
(it used to stay in every finished run), without letting a launch that opened it meanwhile share it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dllm.cli.main import main
from dllm.errors import CheckpointError
from dllm.training.metrics import read_metrics
from dllm.training.run_lock import LOCK_NAME, lock_run_dir
from tests.helpers import tiny_train_values, write_yaml
from tests.reliability.launch_helpers import SMALL, start_launch, wait_for


def _holder(run_dir: Path) -> dict:
    return json.loads((run_dir / LOCK_NAME).read_text())


def test_a_second_launch_into_a_running_run_is_refused(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    write_yaml(workdir / "train.yaml", tiny_train_values(**SMALL, training={"steps": 100_000}))
    run_dir = workdir / "runs" / "t"
    first = start_launch(workdir)
    try:
        assert wait_for(lambda: len(read_metrics(run_dir)) >= 2, 60), "the first launch did not start training"
        config_before = (run_dir / "config.yaml").read_text()
        monkeypatch.chdir(workdir)  # the second launch runs here, as a user would type it in the same folder
        code = main(["launch", "--config", "train.yaml", "--set", "training.steps=4"])
        err = capsys.readouterr().err.strip()
        assert first.poll() is None
    finally:
        first.kill()
        first.wait()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert err.startswith(f"dllm: error: {run_dir} is in use by another dllm launch (host ")
    assert f"pid {first.pid}," in err and "another run.name" in err
    assert (run_dir / "config.yaml").read_text() == config_before  # the holder's folder is untouched


def test_the_lock_of_a_dead_launch_is_taken_over(
    workdir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    write_yaml(workdir / "train.yaml", tiny_train_values(**SMALL, training={"steps": 2}))
    run_dir = workdir / "runs" / "t"
    take_and_die = (
        "import os, signal, sys; from pathlib import Path; from dllm.training.run_lock import lock_run_dir; "
        "lock_run_dir(Path(sys.argv[1])); os.kill(os.getpid(), signal.SIGKILL)"
    )
    dead = subprocess.Popen([sys.executable, "-c", take_and_die, str(run_dir)])
    assert dead.wait(timeout=60) == -signal.SIGKILL
    assert _holder(run_dir)["pid"] == dead.pid  # its stamp stays; the kernel released its flock
    monkeypatch.chdir(workdir)
    assert main(["launch", "--config", "train.yaml"]) == 0, capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    assert not (run_dir / LOCK_NAME).exists()  # taken over, then removed at the normal end


def test_a_normal_end_leaves_no_lock_file(workdir: Path, monkeypatch: pytest.MonkeyPatch):
    write_yaml(workdir / "train.yaml", tiny_train_values(**SMALL, training={"steps": 2}))
    monkeypatch.chdir(workdir)
    assert main(["launch", "--config", "train.yaml"]) == 0
    assert main(["launch", "--config", "train.yaml", "--set", "training.steps=4"]) == 0  # a resume too
    assert sorted(p.name for p in (workdir / "runs" / "t").iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]


def test_a_launch_that_opened_the_file_its_holder_removes_takes_a_new_one(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    """The holder ends normally between the next launch's open and its flock: that flock then succeeds on a
    removed file, which locks nothing anyone else opens; the launch must lock the file at the path instead."""
    import dllm.training.run_lock as run_lock

    held, real_flock = lock_run_dir(tmp_path), run_lock._flock

    def holder_ends_first(fd: int, *args) -> None:
        held.release(remove=True)
        monkeypatch.setattr(run_lock, "_flock", real_flock)
        real_flock(fd, *args)

    monkeypatch.setattr(run_lock, "_flock", holder_ends_first)
    taken = lock_run_dir(tmp_path)
    with pytest.raises(CheckpointError, match="in use by another dllm launch"):
        lock_run_dir(tmp_path)  # a third launch opens the file at the path: the one `taken` holds
    taken.release(remove=True)
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_lock_names_its_holder_and_is_released(tmp_path: Path):
    held = lock_run_dir(tmp_path / "run")
    stamp = _holder(tmp_path / "run")
    assert stamp["pid"] == os.getpid() and stamp["host"]
    with pytest.raises(CheckpointError, match=rf"in use by another dllm launch \(host .*, pid {os.getpid()}, since "):
        lock_run_dir(tmp_path / "run")  # another open file description conflicts, even in one process
    held.release()
    lock_run_dir(tmp_path / "run").release()
    assert (tmp_path / "run" / LOCK_NAME).exists()  # never deleted
