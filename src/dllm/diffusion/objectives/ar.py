"""Autoregressive next-token training: the causal baseline and the target of speculative decoding.

The model runs the clean sequence under the causal mask; the hidden state at i-1 predicts token i
(the plain language-modelling loss). Like the diffusion objectives it honours the supervision mask:
only supervised tokens are targets (completion-only SFT), and position 0 has no predictor. With a
document mask attention stays inside each document. No noise: `prepare` is deterministic.

Shapes: B batch, L sequence.
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.objectives import ARConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.diffusion.objectives.mdlm import weighted_ce
from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.models.output import ModelOutput


class ARObjective:
    def __init__(self, cfg: ARConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False) -> None:
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids = cfg, ids
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy

    def normalizer(self, batch: Batch) -> int:
        return int(batch.loss_mask_BL[:, 1:].sum())  # position 0 is never a target

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        tokens, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = tokens.shape
        positions = torch.arange(L, device=tokens.device).expand(B, L)
        weights = sup.float()
        weights[:, 0] = 0.0
        rows = (torch.arange(L, device=tokens.device) - 1).clamp_min(0).expand(B, L)  # hidden i-1 predicts i
        mask = AttentionMask("causal", doc_ids_BL=batch.doc_ids_BL)
        return ModelInputs(tokens, positions, mask, tokens, weights, loss_rows=rows)

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        # the mask token is excluded from the softmax as in every objective here: it is never a prediction
        return weighted_ce(out, inputs, self.cross_entropy, self.ids.mask_id)
