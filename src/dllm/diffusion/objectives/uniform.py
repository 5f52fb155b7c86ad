"""Uniform-state diffusion (D3PM's uniform kernel, Austin et al. 2021; UDLM, Schiff et al. 2024).

Each supervised token is replaced by a uniformly random vocabulary id (never the mask id: there is
no mask token) with probability 1 - alpha(t). The model cannot tell which tokens were replaced, so it
predicts x_0 at every supervised position: the loss is the x_0 cross-entropy over all of them (the
simplified objective, not the continuous-time uniform ELBO). Optional self-conditioning: with
probability p a row is conditioned on a detached first pass's predictions (Chen et al. 2022).
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.objectives import UniformConfig
from dllm.config.registries import SCHEDULES
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, corrupt_tokens, uniform_token_ids
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.diffusion.objectives.mdlm import weighted_ce
from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.models.output import ModelOutput


class UniformObjective:
    def __init__(
        self, cfg: UniformConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False
    ) -> None:
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids = cfg, ids
        self.schedule = SCHEDULES.resolve(cfg.schedule)()
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy

    def normalizer(self, batch: Batch) -> int:
        return batch.num_targets

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        x0, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = x0.shape
        u_B = noise.stratified_time(batch.sample_ids_B, "uniform.t", self.cfg.antithetic)
        t_B = 1.0 - (1.0 - self.cfg.eps) * u_B
        p_BL = (1.0 - self.schedule.alpha(t_B))[:, None].expand(B, L)
        replacement = uniform_token_ids(noise.uniform(batch.sample_ids_B, (L,), "uniform.ids"),
                                        self.ids.num_tokens, self.ids.mask_id)  # fmt: skip
        noisy, _ = corrupt_tokens(x0, sup, p_BL, noise.uniform(batch.sample_ids_B, (L,), "uniform.hit"), replacement)
        rows = None
        if self.cfg.self_condition_prob > 0:
            rows = noise.uniform(batch.sample_ids_B, (), "uniform.self_cond") < self.cfg.self_condition_prob
        positions = torch.arange(L, device=x0.device).expand(B, L)
        mask = AttentionMask("bidirectional", doc_ids_BL=batch.doc_ids_BL)
        return ModelInputs(noisy, positions, mask, x0, sup.float(), self_cond_rows_B=rows)

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        return weighted_ce(out, inputs, self.cross_entropy, self.ids.mask_id)
