"""The trainer scaffold: what supervised training (training/trainer.py) and rl (training/grpo.py) share.

A run is a loop of units until `training.steps` optimizer steps are done. A unit is one optimizer step
of the supervised `Trainer`, or one generation round of `rl.inner_updates` optimizer steps of the
`GRPOTrainer`. Everything around a unit lives here once, so the two loops cannot drift apart: the
progress line, the metrics records, timing and the compiled warm-up, the NaN/Inf stop, the profiler
window, periodic and final checkpoints, and resume. A trainer supplies only its unit (`run_unit`), the
metrics record of a unit (`report`), and the state it adds to a checkpoint (`state_dict` /
`load_state_dict`, extending the shared part). training/build.py assembles the shared parts
(`TrainParts`) once for both.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from dllm.checkpoint.manager import TRAINER_STATE, CheckpointManager
from dllm.config.training import MAX_STEPS, LoggingConfig, TrainingConfig
from dllm.config.untrusted import count
from dllm.errors import CheckpointError, TrainingError
from dllm.parallel.dims import DistEnv, ParallelDims
from dllm.parallel.grad_norm import clip_grad_norm
from dllm.training.lr import LRSchedule
from dllm.training.metrics import MetricsLogger
from dllm.training.profiler import StepProfiler
from dllm.training.progress import Progress


@dataclass
class TrainParts:
    """The pieces every trainer is built around (training/build.py makes them the same way for both)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    lr_schedule: LRSchedule
    checkpoints: CheckpointManager
    metrics: MetricsLogger
    cfg: TrainingConfig
    log_cfg: LoggingConfig
    env: DistEnv
    dims: ParallelDims
    device: torch.device
    identity: dict[str, Any]
    """Tokenizer identity and what the run trains on (artifact fingerprint, prompt set), checked on resume."""
    profiler: StepProfiler | None = None
    """torch.profiler traces of the `profiling:` section's steps; None without one."""


@dataclass
class Unit:
    """What one unit of work hands the loop."""

    loss: float
    """The unit's loss: what `fit` returns and the progress line shows."""
    checked: list[tuple[float, float]]
    """(loss, gradient norm) of each optimizer step the unit took, in order: what the NaN/Inf stop reads."""
    num_tokens: int
    """Tokens the unit went through (the progress line's tokens/s)."""
    compute_s: float
    """Seconds of model compute (forward + backward): on a compiled run's first unit, its warm-up bound."""


U = TypeVar("U", bound=Unit)


class TrainLoop(Generic[U]):
    """The outer loop and the resume of a trainer whose unit of work is `U`."""

    steps_per_unit = 1
    """Optimizer steps one unit takes (an rl round takes rl.inner_updates)."""
    logs_every_unit = False
    """True: a metrics record after every unit; False: every logging.every_steps steps and the last."""
    damaged = f"{{path}}/{TRAINER_STATE}: damaged ({{error}}); use another checkpoint"
    """The one-line error of a checkpoint whose trainer state does not load."""

    def __init__(self, parts: TrainParts) -> None:
        self.model, self.optimizer, self.lr_schedule = parts.model, parts.optimizer, parts.lr_schedule
        self.checkpoints, self.metrics, self.profiler = parts.checkpoints, parts.metrics, parts.profiler
        self.cfg, self.log_cfg = parts.cfg, parts.log_cfg
        self.env, self.dims, self.device = parts.env, parts.dims, parts.device
        self.identity = parts.identity
        self.step = 0

    # -- what a trainer supplies ------------------------------------------------------------------
    def run_unit(self) -> U:
        """Do one unit of work, advancing `self.step` by `steps_per_unit`."""
        raise NotImplementedError

    def report(self, unit: U, step_s: float) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the unit's metrics record, the extra numbers its progress line shows), given its wall time."""
        raise NotImplementedError

    def optimizer_step(self) -> float:
        """Clip the gradients to training.grad_clip, step the optimizer and clear the gradients; returns the
        gradient norm before clipping (over all ranks' shards: parallel/grad_norm.py)."""
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip is not None else float("inf")
        grad_norm = clip_grad_norm(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm)

    # -- resume -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's trainer state besides the model and the optimizer (JSON); trainers add theirs."""
        lr_schedule = self.lr_schedule.state_dict()
        return {"lr_schedule": lr_schedule, "identity": self.identity, "world_size": self.env.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_schedule.load_state_dict(state["lr_schedule"])
        self.step = count(state["step"], "step", MAX_STEPS)

    def check_checkpoint(self, path: Path, state: dict[str, Any]) -> None:
        """A CheckpointError when the checkpoint cannot go on as this run (another tokenizer)."""
        saved = state.get("identity", {}).get("tokenizer", {})
        if saved.get("vocab_hash") != self.identity["tokenizer"]["vocab_hash"]:
            raise CheckpointError(
                f"{path}: the checkpoint was trained with a different tokenizer; "
                "use the original tokenizer or start a new run (another run.name)"
            )

    def resume(self, path: Path) -> None:
        """Load the weights and the optimizer (checkpoint/manager.py), then the trainer state."""
        state = self.checkpoints.load(path, self.model, self.optimizer)
        try:
            self.check_checkpoint(path, state)
            self.load_state_dict(state)
        except (KeyError, TypeError, ValueError, AttributeError, RuntimeError, IndexError) as e:
            # a damaged or hand-edited state, or one of another kind of run
            raise CheckpointError(self.damaged.format(path=path, error=f"{type(e).__name__}: {e}")) from None

    # -- the loop ---------------------------------------------------------------------------------
    def fit(self) -> list[float]:
        """Run units up to `training.steps` optimizer steps; returns the loss of each unit run in this call."""
        progress = Progress(self.log_cfg, self.cfg.steps, self.step, enabled=self.env.is_main)
        self.metrics.start(self.step)  # the log now ends at this step: no duplicate after a resume
        start_step, losses = self.step, []
        # for the next metrics record: the warm-up's compile_s; and when it is the log's first, the run's CPU
        # threads (training.threads): a fact of the run, not of a step, so a resume that goes on with a log
        # writes the same records as a run never stopped (the launch line shows each start's threads)
        pending: dict[str, Any] = {"threads": torch.get_num_threads()} if self.metrics.first else {}
        try:
            while self.step < self.cfg.steps:
                unit, step_s, (record, shown) = self._timed_unit()
                if not losses and self.cfg.compile is True:
                    # the first call of each compiled block compiles it: this unit's forward + backward
                    # is the warm-up (compile time plus one unit's compute, an upper bound)
                    pending["compile_s"] = round(unit.compute_s, 3)
                    shown = {**shown, **pending}
                losses.append(unit.loss)
                progress.update(self.step, unit.loss, unit.num_tokens / step_s, shown)
                if self.logs_every_unit or self.step % self.log_cfg.every_steps == 0 or self.step == self.cfg.steps:
                    self.metrics.log(self.step, {**record, **pending})
                    pending = {}
                self._after_unit()
        finally:
            progress.close()
            if self.profiler is not None:
                self.profiler.close(self.step, start_step)
        return losses

    def _timed_unit(self) -> tuple[U, float, tuple[dict[str, Any], dict[str, Any]]]:
        """One unit inside the profiler's window, checked before anything is logged or saved."""
        if self.profiler is not None:
            self.profiler.before_step(self.step + 1, self.step + self.steps_per_unit)
        t0 = time.perf_counter()
        unit = self.run_unit()
        check_finite(unit.checked, self.step - len(unit.checked) + 1)
        step_s = time.perf_counter() - t0
        return unit, step_s, self.report(unit, step_s)

    def _after_unit(self) -> None:
        if self.profiler is not None:
            self.profiler.after_step(self.step)
        if self.checkpoints.should_save(self.step, self.cfg.steps):  # on every rank: a state_dict may gather
            self.checkpoints.save(self.step, self.model, self.optimizer, self.state_dict())


def check_finite(checked: list[tuple[float, float]], first_step: int) -> None:
    """Stop a diverged run at its first step whose loss or gradient norm is NaN/Inf (numbered from
    `first_step`): its weights are already NaN/Inf after that step, so nothing is saved. The numbers are
    reduced over ranks, so every rank stops at the same step."""
    for step, (loss, grad_norm) in enumerate(checked, first_step):
        bad = {name: v for name, v in (("loss", loss), ("gradient norm", grad_norm)) if not math.isfinite(v)}
        if bad:
            what = " and ".join(f"{name} is {v}" for name, v in bad.items())
            raise TrainingError(
                f"step {step}: the {what}; stopped without saving this step (the last checkpoint is intact). "
                "Lower optimizer.lr, or train in float32 or bfloat16 rather than float16 (training.autocast_dtype)"
            )
