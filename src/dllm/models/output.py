"""What the model contract passes in and out: `forward(tokens, positions, mask, cache=None) -> ModelOutput`.

The model returns its final hidden states and its output head, not logits, so that a loss computes
logits only where it needs them and in chunks (never the full [B, L, V]); `aux` carries auxiliary
training losses (the MoE router's load balancing) as values, not as module attributes.

Shapes: B batch, L sequence, E hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

EditHeadFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
HeadFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]]


@dataclass(frozen=True)
class ModelOutput:
    """Final hidden states (row i: the state at position i, never shifted), the head, aux losses."""

    hidden_BLE: torch.Tensor
    head: HeadFn
    """hidden [..., E] -> (features [..., E], output weight [V, E], output bias [V] or None)."""
    aux: dict[str, torch.Tensor] = field(default_factory=dict)
    """Auxiliary losses of this forward, e.g. `router_loss` (MoE load balancing, a scalar)."""
    edit: EditHeadFn | None = None
    """A model built with `edit_head` (Edit Flows): hidden [..., E] -> (rates [..., 3] >= 0 for
    insert-after / delete / substitute, insertion features [..., E] for `head`); None otherwise."""

    def logits(self) -> torch.Tensor:
        features, weight, bias = self.head(self.hidden_BLE)
        return F.linear(features, weight, bias)


@dataclass(frozen=True)
class SelfConditioned:
    """Token ids with a previous pass's predicted ids (self-conditioning, Chen et al. 2022 "Analog
    Bits"): the model adds the embedding of `previous_BL` where it is >= 0 (-1: no conditioning).
    Passed as `tokens` to a model built with `self_condition: true`."""

    ids_BL: torch.Tensor
    previous_BL: torch.Tensor
