"""Observability sections: Weights & Biases logging and torch.profiler traces of chosen steps."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from dllm.config.base import Int, Section


class WandbConfig(Section):
    """Weights & Biases: the resolved config and every metric record go to a W&B run (main rank only)."""

    project: str = Field(default="dllm", min_length=1)
    """W&B project the run is logged to."""
    name: str | None = None
    """Display name of the W&B run; null uses run.name."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """online: stream to the W&B server; offline: files in RUN/wandb/ only (`wandb sync` later); disabled: off."""
    tags: tuple[str, ...] = ()
    """Tags of the W&B run."""


class ProfilingConfig(Section):
    """A torch.profiler trace of a few steps, written to the run folder's profile/."""

    start_step: Int = Field(default=3, gt=0)
    """First profiled step (steps count from 1; the first ones include warm-up work such as compilation)."""
    steps: Int = Field(default=2, gt=0)
    """Number of consecutive steps profiled."""
    record_shapes: bool = False
    """Record the input shapes of every op (larger trace)."""
    memory: bool = False
    """Record tensor allocations in the trace, and on CUDA also write a memory snapshot (torch.cuda.memory)."""
