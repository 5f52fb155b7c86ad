"""DiffusionGemma's native SFT (objective diffusiongemma_native_sft).

One forward over [clean ; canvas] (2L rows, models/families/diffusion_gemma.py) under the
prefix_canvas mask with canvas_start 0: the clean half is the encoder's causal stream, and the canvas
half holds every response block at once, block k of a row standing where it would be decoded (its
queries see the clean rows before the block and the block itself). Blocks of `block_size` tokens are
aligned to each row's response start, as sampling lays canvases after the prompt.

Corruption (uniform-state, no mask token): per row and block t ~ U(eps, 1] (stratified over the
global batch x blocks); each supervised token of the block is replaced by a uniformly random id with
probability t. Loss: the canvas cross-entropy on every supervised token, corrupted or not (weight 1),
plus the clean stream's next-token cross-entropy on every supervised token after the first
(weight `encoder_loss_weight`), both on the soft-capped logits; normalised by supervised tokens.
Self-conditioning is drawn per example with probability `self_condition_prob`: the trainer runs a
detached first pass and conditions those examples' canvases on its logits (training/trainer.py).

Supervision must be full or one contiguous suffix of the row's tokens (a prompt, then the response;
padding after it is allowed): anything else (several records in a row) is refused in one line.

Shapes: B batch, L sequence (of the data), K blocks per row.
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.objectives import DiffusionGemmaSFTConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, corrupt_tokens, uniform_token_ids
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.diffusion.objectives.mdlm import weighted_ce
from dllm.errors import DataError
from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.models.output import ModelOutput


class DiffusionGemmaSFT:
    def __init__(
        self, cfg: DiffusionGemmaSFTConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False
    ) -> None:
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids = cfg, ids
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy

    def normalizer(self, batch: Batch) -> int:
        return batch.num_targets

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        x0, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = x0.shape
        start_B, valid_BL = response_span(x0, sup, self.ids.pad_id, batch.doc_ids_BL)
        canvas = self.corrupt(batch, start_B, noise)
        positions = torch.arange(L, device=x0.device).expand(B, L)
        mask = AttentionMask(
            "prefix_canvas", key_valid_BL=torch.cat([valid_BL, valid_BL], dim=1), block_size=self.cfg.block_size,
            num_clean=L, canvas_start=0, canvas_origin_B=start_B,
        )  # fmt: skip
        next_BL = torch.cat([x0[:, 1:], x0[:, -1:]], dim=1)  # clean row i predicts token i + 1 (the encoder's loss)
        next_sup_BL = torch.cat([sup[:, 1:], torch.zeros_like(sup[:, :1])], dim=1)
        weights = torch.cat([self.cfg.encoder_loss_weight * next_sup_BL.float(), sup.float()], dim=1)
        rows = None
        if self.cfg.self_condition_prob > 0:
            rows = noise.uniform(batch.sample_ids_B, (), "dgemma.self_cond") < self.cfg.self_condition_prob
        return ModelInputs(
            torch.cat([x0, canvas], dim=1), torch.cat([positions, positions], dim=1), mask,
            torch.cat([next_BL, x0], dim=1), weights, self_cond_rows_B=rows,
        )  # fmt: skip

    def corrupt(self, batch: Batch, start_B: torch.Tensor, noise: NoiseKeys) -> torch.Tensor:
        """Every supervised token replaced by a uniform random id with its block's probability t."""
        x0, sup = batch.tokens_BL, batch.loss_mask_BL
        L, S = x0.shape[1], self.cfg.block_size
        K = -(-L // S)
        u_BK = noise.stratified_blocks(batch.sample_ids_B, K, "dgemma.t", self.cfg.antithetic)
        t_BK = 1.0 - (1.0 - self.cfg.eps) * u_BK  # u in [0, 1) -> t in (eps, 1]
        block_BL = ((torch.arange(L, device=x0.device)[None, :] - start_B[:, None]) // S).clamp(0, K - 1)
        p_BL = t_BK.gather(1, block_BL)
        replacement = uniform_token_ids(noise.uniform(batch.sample_ids_B, (L,), "dgemma.ids"),
                                        self.ids.num_tokens, self.ids.mask_id)  # fmt: skip
        hit_u = noise.uniform(batch.sample_ids_B, (L,), "dgemma.hit")
        canvas, _ = corrupt_tokens(x0, sup, p_BL, hit_u, replacement)
        return canvas

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        return weighted_ce(out, inputs, self.cross_entropy, self.ids.mask_id)


def response_span(
    tokens_BL: torch.Tensor, sup_BL: torch.Tensor, pad_id: int, doc_ids_BL: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(start [B]: each row's first supervised token, L if none; valid [B, L]: False at the padding after
    the response). Refuses a row whose supervision is not one contiguous run followed only by padding, or
    whose tokens before that padding belong to more than one document (the clean stream is one causal pass)."""
    B, L = sup_BL.shape
    idx_L = torch.arange(L, device=sup_BL.device)
    num_B = sup_BL.sum(1)
    start_B = torch.where(sup_BL, idx_L, L).amin(1)
    end_B = torch.where(sup_BL, idx_L + 1, 0).amax(1)
    after_BL = idx_L[None, :] >= end_B[:, None]
    bad = (num_B > 0) & ((end_B - start_B != num_B) | (after_BL & (tokens_BL != pad_id)).any(1))
    if doc_ids_BL is not None:
        bad |= (num_B > 0) & (~after_BL & (doc_ids_BL != doc_ids_BL[:, :1])).any(1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise DataError(
            f"objective diffusiongemma_native_sft: row {row} of a batch is not one record supervised in one suffix "
            "(prompt, then response, then padding); prepare data with one prompt/completion record per row"
        )
    return start_B, ~(after_BL & (num_B > 0)[:, None])
