"""Nemotron-Labs-Diffusion's joint objective (NVIDIA 2026): one forward, a diffusion and a next-token loss.

The model reads [x_t ; x_0] (positions 0..L-1 twice) under the block-diffusion mask with a token-causal
clean half (`AttentionMask.causal_context`): a noisy block attends itself and the clean blocks before it,
and x_0 is a plain causal LM pass. Following Megatron-Bridge's DGPTStep (dgpt_step.py, the recipe
of the published checkpoints):

- noise: per sequence p = eps + (1 - eps) u, u ~ U[0, 1); every supervised token of x_t is masked with
  probability p (one ratio for the whole sequence, not per block);
- diffusion term: at each masked position i of x_t, CE(head(h_t[i]), x_0[i]) / p (no shift);
- next-token term: at each clean position i-1, CE(head(h_0[i-1]), x_0[i]) for supervised x_0[i], i >= 1;
- loss: (diffusion_weight * sum diffusion + ar_weight * sum next-token) / (number of masked tokens +
  number of next-token targets), per sequence, averaged over sequences (`normalize: sequence`; Megatron
  divides each micro-batch by its own count and the recipe's micro-batch is one sequence), or over the
  global count of next-token targets (`normalize: token`). Both terms share the one output head.

Two choices of dllm's: the mask token is left out of the softmax of both terms (as in every objective
here; it is never a prediction), and a sample that ends in padding is extended with supervised EOS to a
whole block (as in the other block objectives), so that decoding learns where to stop.

Shapes: B batch, L sequence (2L: the two halves).
"""

from __future__ import annotations

import dataclasses

import torch

from dllm.config.objectives import NemotronDiffusionConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, mask_tokens
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.diffusion.objectives.block import pad_blocks_with_eos, two_halves
from dllm.diffusion.objectives.mdlm import weighted_ce
from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.models.output import ModelOutput


class NemotronDiffusionObjective:
    def __init__(
        self, cfg: NemotronDiffusionConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False
    ) -> None:
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids = cfg, ids
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy

    def normalizer(self, batch: Batch) -> int:
        sup = pad_blocks_with_eos(batch, self.cfg.block_size, self.ids).loss_mask_BL
        return int(sup.any(-1).sum() if self.cfg.normalize == "sequence" else sup[:, 1:].sum())

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        """Targets and weights of both terms side by side ([B, 2L]): x_t's rows predict x_0 in place,
        x_0's row i-1 predicts x_0[i] (`loss_rows`)."""
        cfg = self.cfg
        batch = pad_blocks_with_eos(batch, cfg.block_size, self.ids)
        x0, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = x0.shape
        u_B = noise.stratified_time(batch.sample_ids_B, "nemotron.p", cfg.antithetic)
        p_B = cfg.eps + (1 - cfg.eps) * u_B
        u_BL = noise.uniform(batch.sample_ids_B, (L,), "nemotron.mask")
        noisy, masked_BL = mask_tokens(x0, sup, p_B, u_BL, self.ids.mask_id)
        next_BL = sup.clone()
        next_BL[:, 0] = False  # no clean state precedes the first token
        w_diff = masked_BL.float() * (cfg.diffusion_weight / p_B[:, None])
        w_next = next_BL.float() * cfg.ar_weight
        if cfg.normalize == "sequence":
            count_B1 = (masked_BL.sum(-1) + next_BL.sum(-1)).clamp_min(1)[:, None]
            w_diff, w_next = w_diff / count_B1, w_next / count_B1
        i = torch.arange(L, device=x0.device)
        # x_0's last row predicts nothing here: it stands for the first token's (weight 0) predictor
        rows = torch.cat([i, torch.where(i == 0, 2 * L - 1, L + i - 1)]).expand(B, 2 * L)
        tokens, positions, mask = two_halves(noisy, x0, batch.doc_ids_BL, cfg.block_size, causal_context=True)
        return ModelInputs(tokens, positions, mask, x0.repeat(1, 2), torch.cat([w_diff, w_next], 1), loss_rows=rows)

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        """Both terms' sum; metrics: the diffusion term's plain CE over masked tokens (`masked_ce_sum`,
        `num_masked`) and the next-token term's (`ar_ce_sum`, `num_ar`)."""
        L = inputs.targets_BL.shape[1] // 2
        parts = [self._part(inputs, slice(0, L)), self._part(inputs, slice(L, 2 * L))]
        diff, ar = (weighted_ce(out, part, self.cross_entropy, self.ids.mask_id) for part in parts)
        metrics = {**diff.metrics, "ar_ce_sum": ar.metrics["masked_ce_sum"], "num_ar": ar.metrics["num_masked"]}
        return LossOutput(loss_sum=diff.loss_sum + ar.loss_sum, metrics=metrics)

    @staticmethod
    def _part(inputs: ModelInputs, cols: slice) -> ModelInputs:
        assert inputs.loss_rows is not None
        return dataclasses.replace(inputs, targets_BL=inputs.targets_BL[:, cols], weights_BL=inputs.weights_BL[:, cols],
                                   loss_rows=inputs.loss_rows[:, cols])  # fmt: skip
