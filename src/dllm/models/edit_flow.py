"""The Edit Flows head (Havasi et al. 2025): what a model needs to parameterise edit rates.

At every position i of the current sequence the model gives three non-negative intensities lambda,
insert a token after i, delete i, substitute i, and two token distributions: what to insert after i and what
to put in place of i. Design (the least invasive one that keeps the model contract):

- the block stack is the native bidirectional Transformer, unchanged; `EditHead` is a small module
  on the final hidden states, built when `model.edit_head` is set, and handed out as
  `ModelOutput.edit` (a callable, like `head`), so a loss computes rates and token logits only at
  the positions it needs;
- intensities: softplus of one linear map E -> 3 (softplus keeps them non-negative and smooth at 0).
  They are time-free: the edit rate at time t is w(t) * lambda with the scheduler weight
  w(t) = kappa'(t) / (1 - kappa(t)) factored out (diffusion/objectives/edit_flow.py), so lambda is the
  model's estimate of the edits still to do at i, read off the sequence itself (the model has no t);
- the substitution distribution is the ordinary LM head on the hidden state (what token belongs
  here), the insertion distribution is the same shared output matrix applied to a second projection
  of the hidden state (what token follows here), so no second vocabulary-sized matrix is needed.

Shapes: E hidden width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INSERT, DELETE, SUBSTITUTE = 0, 1, 2
"""Index of each edit kind in the last dimension of the intensities."""


def edit_token_log_probs(head, features_NE: torch.Tensor, num_tokens: int, anchor_id: int) -> torch.Tensor:
    """log Q [N, V] (what to insert / substitute) through the shared output `head` (ModelOutput.head):
    the anchor id (the sequence-start token, never produced) and ids past `num_tokens` get probability 0."""
    feats, weight_VE, bias_V = head(features_NE)
    logits_NV = F.linear(feats, weight_VE, bias_V)
    if logits_NV.dtype in (torch.bfloat16, torch.float16):
        logits_NV = logits_NV.float()
    banned_V = torch.arange(logits_NV.shape[-1], device=logits_NV.device) >= num_tokens
    banned_V[anchor_id] = True
    return logits_NV.masked_fill(banned_V, float("-inf")).log_softmax(-1)


class EditHead(nn.Module):
    """hidden [..., E] -> (intensities lambda [..., 3] >= 0: insert-after, delete, substitute; insertion
    features [..., E])."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.rate_proj = nn.Linear(hidden_size, 3)
        self.insert_proj = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.softplus(self.rate_proj(hidden)), self.insert_proj(hidden)
