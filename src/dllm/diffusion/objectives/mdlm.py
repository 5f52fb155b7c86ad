"""MDLM / LLaDA masked diffusion (Sahoo et al. 2024; Nie et al. 2025).

Per sequence t ~ U(eps, 1]; each supervised token is replaced by the mask token with probability
1 - alpha(t); the loss is the cross-entropy on masked tokens weighted by w(t) (1/t for the linear
schedule). The mask token itself is never a valid prediction. Unsupervised tokens (an SFT prompt)
are never noised. Normalisation: by supervised tokens, or per sequence (LLaDA's SFT loss divides
each answer by its own length).
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.objectives import MDLMConfig
from dllm.config.registries import SCHEDULES
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, mask_tokens
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.models.chunked_ce import Certainty, linear_cross_entropy, plain_cross_entropy
from dllm.models.output import ModelOutput


class MDLMObjective:
    def __init__(self, cfg: MDLMConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False) -> None:
        self.cfg = cfg
        self.ids = ids
        self.mask_id = ids.mask_id
        self.shift_logits = shift_logits  # Dream-style models: position i is predicted from the state at i-1
        self.schedule = SCHEDULES.resolve(cfg.schedule)()
        # the chunked LM head + CE never materialises [tokens x vocab] logits; the plain one is its reference
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy
        self.certainty = certainty_of(cfg)

    def sample_time(self, batch: Batch, noise: NoiseKeys) -> torch.Tensor:
        u_B = noise.stratified_time(batch.sample_ids_B, "mdlm.t", self.cfg.antithetic)
        # u in [0, 1) -> t in (eps, 1]
        return 1.0 - (1.0 - self.cfg.eps) * u_B

    def normalizer(self, batch: Batch) -> int:
        if self.cfg.normalize == "sequence":
            return int(batch.loss_mask_BL.any(-1).sum())
        return batch.num_targets

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        tokens = batch.tokens_BL
        B, L = tokens.shape
        t_B = self.sample_time(batch, noise)
        p_mask_B = 1.0 - self.schedule.alpha(t_B)
        u_BL = noise.uniform(batch.sample_ids_B, (L,), "mdlm.mask")
        noised, masked_BL = mask_tokens(tokens, batch.loss_mask_BL, p_mask_B, u_BL, self.mask_id)
        weights = masked_BL.float() * self.schedule.weight(t_B)[:, None]
        if self.cfg.normalize == "sequence":
            weights = weights / batch.loss_mask_BL.sum(-1, keepdim=True).clamp_min(1)
        positions = torch.arange(L, device=tokens.device).expand(B, L)
        mask = AttentionMask("bidirectional", doc_ids_BL=batch.doc_ids_BL)
        rows = None
        if self.shift_logits:  # hidden i-1 predicts token i; position 0 reads its own state (Dream)
            rows = (torch.arange(L, device=tokens.device) - 1).clamp_min(0).expand(B, L)
        return ModelInputs(noised, positions, mask, tokens, weights, loss_rows=rows)

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        return weighted_ce(out, inputs, self.cross_entropy, self.mask_id, self.certainty)


def certainty_of(cfg) -> Certainty | None:
    """The certainty-forcing term of an objective section that has one (`certainty:`), or None."""
    section = getattr(cfg, "certainty", None)
    return None if section is None else Certainty(section.weight, section.temperature)


def weighted_ce(
    out: ModelOutput, inputs: ModelInputs, cross_entropy, exclude_id: int, certainty: Certainty | None = None
) -> LossOutput:
    """sum(w * CE) over positions with a weight; the head runs on just those rows. Shared by every
    objective: `inputs.loss_rows` says which hidden position predicts each target (shifted models).
    `certainty`: plus the certainty-forcing entropy of the rows predicted right (models/chunked_ce.py); its
    metrics are their count and the sum of their tempered entropies."""
    sel_BL = inputs.weights_BL > 0
    hidden_BLE = out.hidden_BLE
    if inputs.loss_rows is not None:
        hidden_BLE = hidden_BLE.gather(1, inputs.loss_rows[..., None].expand(-1, -1, hidden_BLE.shape[-1]))
    else:
        hidden_BLE = hidden_BLE[:, : sel_BL.shape[1]]
    features_NE, weight_VE, bias_V = out.head(hidden_BLE[sel_BL])
    kw = {} if out.logit_softcap is None else {"softcap": out.logit_softcap}  # Gemma's soft-capped logits
    if certainty is not None:
        kw["certainty"] = certainty
    loss_sum, ce_N, *forcing = cross_entropy(
        features_NE, weight_VE, inputs.targets_BL[sel_BL], inputs.weights_BL[sel_BL],
        exclude_ids=(exclude_id,), bias_V=bias_V, **kw,
    )  # fmt: skip
    metrics = {"masked_ce_sum": ce_N.detach().sum(), "num_masked": sel_BL.sum()}
    if forcing:
        entropy_N, forced_N = forcing
        metrics |= {"certain_entropy_sum": (entropy_N * forced_N).sum(), "num_certain": forced_N.sum()}
    return LossOutput(loss_sum=loss_sum, metrics=metrics)
