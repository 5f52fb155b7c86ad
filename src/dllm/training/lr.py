"""Learning rate as a pure function of the step: linear warmup, then cosine/linear decay or constant."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from dllm.config.registries import LR_SCHEDULES
from dllm.config.training import MAX_STEPS, SchedulerConfig
from dllm.config.untrusted import count

Decay = Callable[[float, float], float]
"""(progress after warmup in [0, 1], floor = min_lr_ratio) -> the fraction of the peak learning rate."""


def cosine_decay(progress: float, floor: float) -> float:
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def linear_decay(progress: float, floor: float) -> float:
    return 1.0 - (1 - floor) * progress


def constant(progress: float, floor: float) -> float:
    return 1.0


class LRSchedule:
    def __init__(self, cfg: SchedulerConfig, peak_lr: float, total_steps: int) -> None:
        self.cfg = cfg
        self.peak_lr = peak_lr
        self.total_steps = total_steps
        self.step = 0
        self.decay: Decay = LR_SCHEDULES.resolve(cfg.name)

    def lr_at(self, step: int) -> float:
        """LR for optimizer step `step` (0-based)."""
        warm = self.cfg.warmup_steps
        if step < warm:
            return self.peak_lr * (step + 1) / warm
        progress = min((step - warm) / max(self.total_steps - warm, 1), 1.0)
        return self.peak_lr * self.decay(progress, self.cfg.min_lr_ratio)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.step = step
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = count(state["step"], "lr_schedule.step", MAX_STEPS)
