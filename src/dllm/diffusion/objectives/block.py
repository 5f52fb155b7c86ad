"""Block diffusion objectives over the vectorised 2L layout [x_t ; x_0].

BD3LM (Arriola et al. 2025): the model sees the noisy sequence and the clean one (both with positions
0..L-1) under the block-diffusion mask: a noisy block attends itself and the clean blocks before it;
the clean half is block-causal. One forward trains every block; the loss is on the noisy half only.
t is drawn per block (stratified over batch x blocks) from a clipped interval [eps_min, eps_max].

Fast-dLLM v2 (Wu et al. 2025): the same layout for an AR-initialised model, with complementary masks
(two views of each sequence; every supervised token is masked in exactly one of them) and the AR
token shift: token i is predicted from the hidden state at i-1, and a block's first token from the
last clean token of the previous block (the only earlier state a noisy block can see). The two views
share one clean stream: a row is [x_t^1 ; x_t^2 ; x_0] (3L rows, the mask's `views` = 2), whose
states equal those of two 2L rows [x_t^v ; x_0] (x_0 never sees a noisy row, and a view never sees the
other), so the loss and its gradient are the two-row layout's with x_0 computed once: 3L rows instead
of 4L. Linear-attention layers and context/block parallelism run the two-row layout (`shared_clean`).

Shapes: B batch, L sequence, K blocks (L / block), E hidden.
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.objectives import BD3LMConfig, FastDLLMv2Config
from dllm.config.registries import SCHEDULES
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, corrupt_tokens, uniform_token_ids
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.diffusion.objectives.mdlm import certainty_of, weighted_ce
from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.models.output import ModelOutput


def pad_blocks_with_eos(batch: Batch, block: int, ids: TokenIds) -> Batch:
    """A sample that ends in padding (indexed layout) is extended with supervised EOS to a whole
    block, so that its last block is complete; the rest of the padding stays unsupervised."""
    tokens, sup = batch.tokens_BL, batch.loss_mask_BL
    is_pad = (tokens == ids.pad_id) & ~sup
    L = tokens.shape[1]
    pos = torch.arange(L, device=tokens.device)
    # the sample ends where its trailing padding starts
    trailing_BL = is_pad.flip(-1).long().cumprod(-1).flip(-1).bool()
    end_B = torch.where(trailing_BL, pos, L).min(-1).values
    stop_B = (end_B + block - 1) // block * block
    fill_BL = (pos >= end_B[:, None]) & (pos < stop_B[:, None])
    doc = batch.doc_ids_BL
    if doc is not None:  # the EOS belong to the sample's document, not to the padding's
        doc = torch.where(fill_BL, doc.gather(1, (end_B - 1).clamp_min(0)[:, None]).expand_as(doc), doc)
    return Batch(torch.where(fill_BL, ids.eos_id, tokens), sup | fill_BL, batch.sample_ids_B, doc)


def two_halves(
    noisy_BL: torch.Tensor,
    clean_BL: torch.Tensor,
    doc_BL: torch.Tensor | None,
    block: int,
    noisy_only: bool = False,
    causal_context: bool = False,
):
    """Tokens [x_t ; x_0], positions 0..L-1 twice, the block-diffusion mask (documents apply to both).
    `noisy_BL` may hold V noisy copies side by side ([B, V L]): the layout [x_t^1 ; ... ; x_t^V ; x_0].
    `noisy_only`: only x_t's outputs are read, so the model's last layer may skip x_0's queries.
    `causal_context`: x_0 attends token-causally (nemotron_diffusion) instead of block-causally."""
    B, L = clean_BL.shape
    views = noisy_BL.shape[1] // L
    positions = torch.arange(L, device=clean_BL.device).repeat(views + 1).expand(B, (views + 1) * L)
    outputs = views * L if noisy_only else None
    mask = AttentionMask("block_diffusion", block_size=block, doc_ids_BL=doc_BL, num_outputs=outputs,
                         causal_context=causal_context, views=views)  # fmt: skip
    return torch.cat([noisy_BL, clean_BL], dim=1), positions, mask


def shifted_rows(L: int, block: int, device: torch.device, views: int = 1) -> torch.Tensor:
    """For each noisy position i, the hidden position (in 2L) that predicts token i: i-1 inside a
    block, the clean L+i-1 at a block start; position 0 has no predictor (its weight is zeroed). With
    `views` noisy copies ((views + 1) * L rows) the [views * L] rows of all copies: row r of copy r // L
    is predicted by r - 1 inside a block and by the clean views * L + (r mod L) - 1 at a block start;
    each copy's position 0 points at its own first row."""
    r = torch.arange(views * L, device=device)
    i = r % L
    rows = torch.where(i % block == 0, views * L + i - 1, r - 1)
    return torch.where(i == 0, r, rows)


def block_times(batch: Batch, noise: NoiseKeys, num_blocks: int, lo: float, hi: float, antithetic: bool):
    u_BK = noise.stratified_blocks(batch.sample_ids_B, num_blocks, "block.t", antithetic)
    return lo + (hi - lo) * u_BK  # the clipped interval: t in [lo, hi)


class BD3LMObjective:
    def __init__(self, cfg: BD3LMConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False) -> None:
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids = cfg, ids
        self.schedule = SCHEDULES.resolve(cfg.schedule)()
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy
        self.certainty = certainty_of(cfg)

    def normalizer(self, batch: Batch) -> int:
        sup = pad_blocks_with_eos(batch, self.cfg.block_size, self.ids).loss_mask_BL
        return int(sup[:, 1:].sum() if self.cfg.shift else sup.sum())

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        cfg = self.cfg
        batch = pad_blocks_with_eos(batch, cfg.block_size, self.ids)
        x0, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = x0.shape
        t_BL = block_times(batch, noise, L // cfg.block_size, cfg.eps_min, cfg.eps_max, cfg.antithetic)
        t_BL = t_BL.repeat_interleave(cfg.block_size, dim=1)
        u_BL = noise.uniform(batch.sample_ids_B, (L,), "bd3lm.corrupt")
        if cfg.corruption == "mask":
            replacement = torch.full_like(x0, self.ids.mask_id)
        else:
            u_ids = noise.uniform(batch.sample_ids_B, (L,), "bd3lm.ids")
            replacement = uniform_token_ids(u_ids, self.ids.num_tokens, self.ids.mask_id)
        noisy, hit = corrupt_tokens(x0, sup, 1.0 - self.schedule.alpha(t_BL), u_BL, replacement)
        # absorbing noise: the masked tokens, ELBO-weighted; uniform noise: x0 prediction everywhere
        weights = hit.float() * self.schedule.weight(t_BL) if cfg.corruption == "mask" else sup.float()
        # without the shift the loss reads only x_t's hidden states: the last layer skips x_0's queries
        tokens, positions, mask = two_halves(noisy, x0, batch.doc_ids_BL, cfg.block_size, noisy_only=not cfg.shift)
        if not cfg.shift:
            return ModelInputs(tokens, positions, mask, x0, weights)
        rows = shifted_rows(L, cfg.block_size, x0.device).expand(B, L)
        weights = torch.cat([torch.zeros_like(weights[:, :1]), weights[:, 1:]], dim=1)
        return ModelInputs(tokens, positions, mask, x0, weights, loss_rows=rows)

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        return weighted_ce(out, inputs, self.cross_entropy, self.ids.mask_id, self.certainty)


class FastDLLMv2Objective:
    def __init__(
        self,
        cfg: FastDLLMv2Config,
        ids: TokenIds,
        chunked_loss: bool = True,
        shift_logits: bool = False,
        shared_clean: bool = True,
    ) -> None:
        """`shared_clean`: both views in one row over one clean stream ([x_t^1 ; x_t^2 ; x_0], 3L rows); False:
        two rows [x_t^v ; x_0] (4L in all), for linear-attention layers and context/block parallelism."""
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids, self.shared_clean = cfg, ids, shared_clean
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy
        self.certainty = certainty_of(cfg)

    def normalizer(self, batch: Batch) -> int:
        # every supervised token is a target exactly once over the two views (bar position 0)
        return int(pad_blocks_with_eos(batch, self.cfg.block_size, self.ids).loss_mask_BL[:, 1:].sum())

    def prepare(self, batch: Batch, noise: NoiseKeys) -> ModelInputs:
        cfg = self.cfg
        batch = pad_blocks_with_eos(batch, cfg.block_size, self.ids)
        x0, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = x0.shape
        t_BL = block_times(batch, noise, L // cfg.block_size, cfg.eps, 1.0, cfg.antithetic)
        t_BL = t_BL.repeat_interleave(cfg.block_size, dim=1)
        u_BL = noise.uniform(batch.sample_ids_B, (L,), "fast_dllm_v2.mask")
        first = (u_BL < t_BL) & sup
        second = ~first & sup  # the complement: together they mask each supervised token once
        mask_BL = torch.full_like(x0, self.ids.mask_id)
        views = [torch.where(m, mask_BL, x0) for m in (first, second)]
        if self.shared_clean:  # [x_t^1 ; x_t^2 ; x_0]: targets, weights and predicting rows per view
            tokens, positions, mask = two_halves(torch.cat(views, dim=1), x0, batch.doc_ids_BL, cfg.block_size)
            weights = torch.cat([first, second], dim=1).float()
            weights[:, [0, L]] = 0.0  # no hidden state predicts a view's first token
            rows = shifted_rows(L, cfg.block_size, x0.device, views=2).expand(B, 2 * L)
            return ModelInputs(tokens, positions, mask, x0.repeat(1, 2), weights, loss_rows=rows)
        doc = None if batch.doc_ids_BL is None else batch.doc_ids_BL.repeat(2, 1)
        tokens, positions, mask = two_halves(torch.cat(views), x0.repeat(2, 1), doc, cfg.block_size)
        weights = torch.cat([first, second]).float()
        weights[:, 0] = 0.0  # no hidden state predicts the first token
        rows = shifted_rows(L, cfg.block_size, x0.device).expand(2 * B, L)
        return ModelInputs(tokens, positions, mask, x0.repeat(2, 1), weights, loss_rows=rows)

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        return weighted_ce(out, inputs, self.cross_entropy, self.ids.mask_id, self.certainty)
