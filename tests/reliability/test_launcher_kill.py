"""Reliability hardening, the kill test: SIGKILL the launcher of a two-process gloo run at random points (a fixed
seed), from startup to checkpoint publishing. No worker may survive it, `latest` must stay loadable,
the run folder's lock must be free again, and the resumed runs must log every step once."""

from __future__ import annotations

import random
import signal
import time
from pathlib import Path

import pytest

from dllm.checkpoint.loading import load_for_inference
from dllm.checkpoint.manager import latest_checkpoint, read_trainer_state
from dllm.training.metrics import read_metrics
from dllm.training.run_lock import lock_run_dir
from tests.helpers import tiny_train_values, write_yaml
from tests.reliability.launch_helpers import SMALL, kill_leftovers, live_pids, needs_proc, start_launch, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.distributed, needs_proc]


def _kill_points(rng: random.Random) -> list[tuple[int, float]]:
    """(steps to train past the resumed checkpoint, then seconds to wait): one kill during startup
    (0 steps), the others anywhere between and inside the steps and saves (a save every 5 steps)."""
    points = [(0, rng.uniform(0.2, 3.0))] + [(rng.randint(1, 12), rng.uniform(0.0, 0.2)) for _ in range(3)]
    rng.shuffle(points)
    return points


def _last_step(run_dir: Path) -> int:
    return max((r["step"] for r in read_metrics(run_dir)), default=0)


def test_sigkill_of_the_launcher_at_random_points(workdir: Path):
    values = tiny_train_values(**SMALL, training={"steps": 100_000}, checkpointing={"every_steps": 5})
    write_yaml(workdir / "train.yaml", values)
    run_dir = workdir / "runs" / "t"
    published = [0]
    for num_steps, delay_s in _kill_points(random.Random(23)):
        # past the resumed checkpoint, and past what the killed run logged beyond it (this run's own steps)
        target = max(published[-1] + num_steps, _last_step(run_dir) + 1) if num_steps else 0
        proc = start_launch(workdir, "--nproc-per-node", "2")
        try:
            assert wait_for(lambda t=target: _last_step(run_dir) >= t, 120), "training did not get there"
            time.sleep(delay_s)
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            assert wait_for(lambda: not live_pids(workdir), 10), "a worker outlived its launcher"
        finally:
            kill_leftovers(workdir)
            proc.kill()
        lock_run_dir(run_dir).release()  # free: torchrun, which inherits it, is gone too
        latest = latest_checkpoint(run_dir / "checkpoints")
        if latest is not None:
            published.append(read_trainer_state(latest)["step"])
            assert load_for_inference(run=run_dir).model is not None
    assert published[-1] > 0 and published == sorted(published), published
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps == list(range(1, len(steps) + 1))  # resumed, never duplicated
