"""The objective contract: `prepare(batch, noise) -> ModelInputs`, `loss(out, inputs) -> LossOutput`.

The trainer owns the model call between the two (training/trainer.py); an objective never runs the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dllm.attention.masks import AttentionMask
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.models.output import ModelOutput


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
    loss_rows: torch.Tensor | None = None
    """Which hidden positions predict the targets (per position an index into L), when the objective
    shifts predictions (AR-initialised models); None means each position predicts itself."""
    self_cond_rows_B: torch.Tensor | None = None
    """Rows to self-condition on a detached first pass's predictions (uniform objective)."""


@dataclass(frozen=True)
class TokenIds:
    """The tokenizer ids an objective needs."""

    mask_id: int
    eos_id: int
    pad_id: int
    num_tokens: int
    """Ids the tokenizer can produce (the embedding may have more rows, rounded up)."""


@dataclass(frozen=True)
class LossOutput:
    loss_sum: torch.Tensor
    """Sum of weighted per-token losses (the trainer divides by the global target count)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Sums to report (e.g. unweighted CE and count of masked tokens)."""


class Objective(Protocol):
    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs: ...

    def normalizer(self, batch: Batch) -> int:
        """This micro-batch's share of the loss normaliser (summed over the global batch)."""
        ...

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput: ...
