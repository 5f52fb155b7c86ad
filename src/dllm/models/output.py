"""What the model contract passes in and out: `forward(tokens, positions, mask, cache=None) -> ModelOutput`.

The model returns its final hidden states and its output head, not logits, so that a loss computes
logits only where it needs them and in chunks (never the full [B, L, V]); `aux` carries auxiliary
training losses (the MoE router's load balancing) as values, not as module attributes.

Shapes: B batch, L sequence, E hidden, V vocabulary, C canvas rows.
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

    logit_softcap: float | None = None
    """Gemma's final soft-capping: logits = cap * tanh(logits / cap); None: none."""

    def logits(self, rows: slice = slice(None)) -> torch.Tensor:
        """Logits [B, rows, V] of the hidden rows `rows` only, in the model's dtype (training's self-conditioning
        and argmax); decoding, scoring and serving read `token_logits`."""
        features, weight, bias = self.head(self.hidden_BLE[:, rows])
        return softcap(F.linear(features, weight, bias), self.logit_softcap)

    def token_logits(self, hidden_XE: torch.Tensor, exclude_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`token_logits` of hidden states of this output (any rows of `hidden_BLE`, e.g. one block's)."""
        return token_logits(self.head, hidden_XE, self.logit_softcap, exclude_ids)


def token_logits(
    head: HeadFn, hidden_XE: torch.Tensor, cap: float | None, exclude_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """THE logits every decoding loop, the server and evaluation read: hidden states [..., E] -> the head
    -> soft-cap (Gemma's final one) -> float32 at least (float64 stays) -> the ids in `exclude_ids` (e.g.
    the mask token, never a prediction) at -inf. The head runs on the rows given only (it is the largest
    matmul of a small model's forward: a sampler that reads one block of a canvas passes that block's rows)."""
    features, weight, bias = head(hidden_XE)
    logits = softcap(F.linear(features, weight, bias), cap)
    logits = logits if logits.dtype == torch.float64 else logits.float()
    return logits if exclude_ids is None else logits.index_fill(-1, exclude_ids, float("-inf"))


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) in float32 at least (Gemma's final logit soft-capping); unchanged when cap is None."""
    if cap is None:
        return logits
    return torch.tanh(logits.to(torch.promote_types(logits.dtype, torch.float32)) / cap) * cap


@dataclass(frozen=True)
class SelfConditioned:
    """Token ids with a previous pass's predicted ids (self-conditioning, Chen et al. 2022 "Analog
    Bits"): the model adds the embedding of `previous_BL` where it is >= 0 (-1: no conditioning).
    Passed as `tokens` to a model built with `self_condition: true`."""

    ids_BL: torch.Tensor
    previous_BL: torch.Tensor


@dataclass(frozen=True)
class CanvasConditioned:
    """Token ids with the previous denoising step's logits over the canvas rows (DiffusionGemma's
    self-conditioning): passed as `tokens` with a `prefix_canvas` mask, whose rows after `num_clean` are
    the canvas. Without it (plain ids) the canvas gets the zero signal of a first step."""

    ids_BL: torch.Tensor
    logits_BCV: torch.Tensor
    """The previous step's logits over the C canvas rows."""
    on_B: torch.Tensor | None = None
    """Per example: False gives a zero signal, as if no logits were passed (self-conditioning drawn per example)."""
