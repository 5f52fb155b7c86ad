"""Learning rate as a pure function of the step: linear warmup, then cosine/linear decay or constant."""

from __future__ import annotations

import math
from typing import Any

import torch

from dllm.config.training import SchedulerConfig


class LRSchedule:
    def __init__(self, cfg: SchedulerConfig, peak_lr: float, total_steps: int) -> None:
        self.cfg = cfg
        self.peak_lr = peak_lr
        self.total_steps = total_steps
        self.step = 0

    def lr_at(self, step: int) -> float:
        """LR for optimizer step `step` (0-based)."""
        warm = self.cfg.warmup_steps
        if step < warm:
            return self.peak_lr * (step + 1) / warm
        if self.cfg.name == "constant":
            return self.peak_lr
        span = max(self.total_steps - warm, 1)
        progress = min((step - warm) / span, 1.0)
        floor = self.cfg.min_lr_ratio
        if self.cfg.name == "cosine":
            scale = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        else:
            scale = 1.0 - (1 - floor) * progress
        return self.peak_lr * scale

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.step = step
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
