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
    loss_rows: torch.Tensor | None = None
    """Which hidden positions predict the targets (per position an index into L), when the objective
    shifts predictions (AR-initialised models); None means each position predicts itself."""
    self_cond_rows_B: torch.Tensor | None = None
    """Rows to self-condition on a detached first pass's predictions (uniform objective)."""
    num_outputs: int | None = None
    """Only the first N positions' hidden states are used by the loss (the model may skip the rest)."""


@dataclass(frozen=True)
class TokenIds:
    """The tokenizer ids an objective needs."""

    mask_id: int
    eos_id: int
    pad_id: int
    num_tokens: int
    """Ids the tokenizer can produce (the embedding may have more rows, rounded up)."""


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

    def normalizer(self, batch: Batch) -> int:
        """This micro-batch's share of the loss normaliser (summed over the global batch)."""
        ...

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput: ...


def run_model(model: torch.nn.Module, inputs: ModelInputs) -> ModelOutput:
    """THE model call of training and evaluation: one forward to hidden states (a detached first
    pass before it for self-conditioned rows, Chen et al. 2022 "Analog Bits")."""
    args = (inputs.tokens_BL, inputs.positions_BL, inputs.mask)
    kwargs: dict = {"num_outputs": inputs.num_outputs} if inputs.num_outputs is not None else {}
    rows = inputs.self_cond_rows_B
    if rows is not None and bool(rows.any()):
        with torch.no_grad():
            first = ModelOutput(model(*args, return_hidden=True, **kwargs), _head(model))
            guess_BL = _argmax_tokens(first)
        kwargs["self_cond_BL"] = torch.where(rows[:, None], guess_BL, torch.full_like(guess_BL, -1))
    return ModelOutput(model(*args, return_hidden=True, **kwargs), _head(model))


def _head(model: torch.nn.Module) -> HeadFn:
    return getattr(model, "module", model).head  # DDP wraps; FSDP2 modifies in place


def _argmax_tokens(out: ModelOutput, rows_per_chunk: int = 4) -> torch.Tensor:
    """The most likely token per position, a few rows of logits at a time."""
    chunks = [ModelOutput(h, out.head).logits().argmax(-1) for h in out.hidden_BLE.split(rows_per_chunk)]
    return torch.cat(chunks)
