"""The objective contract: `prepare(batch, noise) -> ModelInputs`, `loss(out, inputs) -> LossOutput`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

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


HeadFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


@dataclass(frozen=True)
class ModelOutput:
    """What the model returns to an objective: final hidden states and its output head, so that the
    loss can compute logits only where it needs them, and in chunks (never the full [B, L, V])."""

    hidden_BLE: torch.Tensor
    head: HeadFn
    """hidden [..., E] -> (features [..., E], output weight [V, E], output bias [V] or None)."""

    def logits(self) -> torch.Tensor:
        features, weight, bias = self.head(self.hidden_BLE)
        return F.linear(features, weight, bias)

    @classmethod
    def of_logits(cls, logits_BLV: torch.Tensor) -> ModelOutput:
        """Wrap ready-made logits (tests, reference paths): an identity head over V features."""
        eye = torch.eye(logits_BLV.shape[-1], dtype=logits_BLV.dtype, device=logits_BLV.device)
        return cls(logits_BLV, lambda h: (h, eye, None))


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor
    """Sum of weighted per-token losses (the trainer divides by the global target count)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sums to report (e.g. unweighted CE and count of masked tokens)."""


class Objective(Protocol):
    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs: ...

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput: ...
