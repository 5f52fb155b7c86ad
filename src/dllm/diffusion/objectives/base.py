"""The objective contract: `prepare(batch, noise) -> ModelInputs`, `loss(out, inputs) -> LossOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dllm.attention.masks import AttentionMask
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys


@dataclass(frozen=True)
class ModelInputs:
    """What the model sees and what the loss compares against."""

    tokens_BL: torch.Tensor
    positions_BL: torch.Tensor
    mask: AttentionMask
    targets_BL: torch.Tensor
    """Token ids to predict."""
    weights_BL: torch.Tensor
    """Per-token loss weight; 0 where a position is not in the loss."""


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor
    """Sum of weighted per-token losses (the trainer divides by the global target count)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sums to report (e.g. unweighted CE and count of masked tokens)."""


class Objective(Protocol):
    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs: ...

    def loss(self, logits_BLV: torch.Tensor, inputs: ModelInputs) -> LossOutput: ...
