"""DFlash drafter distillation (Chen et al. 2025, "DFlash: Block Diffusion for Flash Speculative Decoding").

The trained model is a DFlash drafter (models/dflash.py); the target is a frozen causal LM this
objective holds (training/build.py loads it from `objective.target`). For each micro-batch:

1. the target runs once, without gradients, under the causal mask: the outputs of its blocks
   `target_layer_ids` are the context features, and its own next-token predictions (hidden i
   predicts token i + 1) are the labels: its greedy tokens (`loss: ce`) or its distribution (`kl`);
2. `num_anchors` anchors p are drawn per sequence (keyed by sample id, so every rank and resume
   draws the same) among positions 1 .. L - b whose next token is supervised (in a packed row: in
   the anchor's document, after its first token);
3. every anchor's draft block [x_p, MASK x (b-1)] (positions p .. p+b-1) goes into ONE drafter
   forward, concatenated; the drafter's mask lets block a see the context features of positions
   < p_a and its own block, nothing else (a mask, not a loop over anchors); in a packed row only its
   own document's positions (the target's pass keeps to documents too), as decoding sees one prompt;
4. block row k (k = 1 .. b-1) is supervised where position p + k is, with weight
   exp(-(k - 1) / gamma) (`decay`: the first proposals decide how many are accepted); its label is the
   target's argmax there, or with `labels: data` the data's token at p + k (the same when the data are
   the target's own greedy answers, without the head pass).

Normalisation: each valid anchor counts b - 1 targets (`normalizer`); the trainer divides the
weighted sum by the global count. Every sequence contributes the same number of anchors (fewer only
when it has fewer valid positions), so the data-parallel ranks, which read equally many sequences,
carry equally many anchors.

Shapes: B batch, L sequence, A anchors per row, b block size, N = A * b, C context, E hidden,
F features, V vocabulary, M supervised draft rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm.config.objectives import DFlashDistillationConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.diffusion.objectives.dflash_features import FeatureCache, target_pass
from dllm.diffusion.objectives.mdlm import weighted_ce
from dllm.models.chunked_ce import linear_cross_entropy, plain_cross_entropy
from dllm.models.dflash import DraftTokens
from dllm.models.output import ModelOutput
from dllm.models.transformer import Transformer

_NEVER = -1e9


@dataclass(frozen=True)
class DraftInputs(ModelInputs):
    """ModelInputs of a drafter, plus the target's logits at the supervised draft rows (loss: kl)."""

    teacher_logits_MV: torch.Tensor | None = None


def doc_starts(doc_ids_BL: torch.Tensor) -> torch.Tensor:
    """[B, L]: the position where each token's document starts in its row (documents are contiguous)."""
    L = doc_ids_BL.shape[1]
    p = torch.arange(L, device=doc_ids_BL.device).expand_as(doc_ids_BL)
    first = torch.ones_like(doc_ids_BL, dtype=torch.bool)
    first[:, 1:] = doc_ids_BL[:, 1:] != doc_ids_BL[:, :-1]
    return torch.where(first, p, torch.zeros_like(p)).cummax(dim=1).values


def position_weights(block_size: int, decay: float | None) -> torch.Tensor:
    """[b]: 0 for the anchor row, exp(-(k - 1) / gamma) for proposal k = 1 .. b-1 (1 without decay)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.ones(block_size) if decay is None else torch.exp(-(k - 1).clamp_min(0) / decay)
    w[0] = 0.0
    return w


class DFlashDistillation:
    def __init__(
        self,
        cfg: DFlashDistillationConfig,
        ids: TokenIds,
        chunked_loss: bool = True,
        shift_logits: bool = False,
        target: Transformer | None = None,
        features: FeatureCache | None = None,
    ) -> None:
        assert target is not None, "training/build.py hands the loaded target to this objective"
        self.cfg, self.ids = cfg, ids
        self.target = target.requires_grad_(False).eval()
        self.features = features  # the target's pass read from a prepared cache (dflash_features.py); None: run it
        self.cross_entropy = linear_cross_entropy if chunked_loss else plain_cross_entropy

    # -- anchors -----------------------------------------------------------------------------------
    def valid_anchors(self, batch: Batch) -> torch.Tensor:
        """[B, L] bool: p in [1, L - b] whose next token is supervised (and in p's document)."""
        tokens, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = tokens.shape
        b = self.cfg.block_size
        p = torch.arange(L, device=tokens.device)
        ok = (p >= 1) & (p <= L - b)
        nxt = torch.cat([sup[:, 1:], torch.zeros_like(sup[:, :1])], dim=1)
        if batch.doc_ids_BL is not None:
            doc = batch.doc_ids_BL
            nxt = nxt & torch.cat([doc[:, 1:] == doc[:, :-1], torch.zeros_like(sup[:, :1])], dim=1)
            ok = ok & (p > doc_starts(doc))  # at least one context position of its own document, as in decoding
        return ok & nxt

    def normalizer(self, batch: Batch) -> int:
        per_row = self.valid_anchors(batch).sum(-1).clamp_max(self.cfg.num_anchors)
        return int(per_row.sum()) * (self.cfg.block_size - 1)

    def pick_anchors(self, batch: Batch, noise: NoiseKeys) -> tuple[torch.Tensor, torch.Tensor]:
        """Anchor positions [B, A] (ascending) and whether each is valid [B, A]: the A valid
        positions with the highest keyed uniform scores (without replacement)."""
        valid = self.valid_anchors(batch)
        L = valid.shape[1]
        u = noise.uniform(batch.sample_ids_B, (L,), "dflash.anchor").to(valid.device)
        score = torch.where(valid, u, torch.full_like(u, -1.0))
        top, pos = score.topk(min(self.cfg.num_anchors, L), dim=-1)
        pos, order = pos.sort(dim=-1)
        ok = top.gather(1, order) >= 0
        return torch.where(ok, pos, torch.ones_like(pos)), ok  # an invalid anchor: position 1, weight 0

    # -- one micro-batch ---------------------------------------------------------------------------
    def prepare(self, batch: Batch, noise: NoiseKeys) -> DraftInputs:
        cfg, b = self.cfg, self.cfg.block_size
        tokens, sup, doc = batch.tokens_BL, batch.loss_mask_BL, batch.doc_ids_BL
        B, L = tokens.shape
        anchors_BA, ok_BA = self.pick_anchors(batch, noise)
        A = anchors_BA.shape[1]
        # the frozen target, once (or its pass read from the feature cache): context features and its
        # final states, whose head gives its next-token predictions
        if self.features is not None:
            features_BLF, hidden_BLE = self.features.lookup(batch)
        else:
            features_BLF, hidden_BLE = target_pass(self.target, cfg.target_layer_ids, batch)
        out = ModelOutput(hidden_BLE, self.target.head)
        C = int(anchors_BA.max())  # no block reads context at or after the last anchor
        context_BCF = features_BLF[:, :C]
        # draft blocks: [x_p, MASK x (b-1)] at positions p .. p+b-1
        k_b = torch.arange(b, device=tokens.device)
        pos_BAb = anchors_BA[..., None] + k_b
        ids_BAb = torch.full_like(pos_BAb, self.ids.mask_id)
        ids_BAb[..., 0] = tokens.gather(1, anchors_BA)
        # block row k predicts position p + k from the target's state at p + k - 1
        pos_BN = pos_BAb.reshape(B, A * b)
        same_doc = torch.ones_like(pos_BAb, dtype=torch.bool)
        context_start_BA = None  # packed rows: a block reads its own document's context only, as in decoding
        if doc is not None:
            context_start_BA = doc_starts(doc).gather(1, anchors_BA)
            same_doc = (doc.gather(1, pos_BN) == doc.gather(1, anchors_BA).repeat_interleave(b, 1)).view(B, A, b)
        weights_BAb = position_weights(b, cfg.decay).to(tokens.device) * (
            sup.gather(1, pos_BN).view(B, A, b) & same_doc & ok_BA[..., None]
        )
        weights_BN = weights_BAb.reshape(B, A * b)
        sel_BN = weights_BN > 0
        targets_BN = torch.zeros_like(pos_BN)
        teacher_MV = None
        if cfg.labels == "data":  # the data's next tokens: the target's own when the data are its greedy answers
            targets_BN[sel_BN] = tokens.gather(1, pos_BN)[sel_BN]
        else:
            teacher_MV = self._teacher_logits(out, (pos_BN - 1).clamp_min(0)[sel_BN], sel_BN)
            targets_BN[sel_BN] = teacher_MV.argmax(-1)
        return DraftInputs(
            tokens_BL=DraftTokens(ids_BAb.reshape(B, A * b), context_BCF, anchors_BA, context_start_BA),  # type: ignore[arg-type]
            positions_BL=pos_BN,
            mask=None,  # type: ignore[arg-type]  # the drafter's pattern comes from the anchors
            targets_BL=targets_BN,
            weights_BL=weights_BN,
            teacher_logits_MV=teacher_MV if cfg.loss == "kl" else None,
        )

    @torch.no_grad()
    def _teacher_logits(self, out: ModelOutput, rows_M: torch.Tensor, sel_BN: torch.Tensor) -> torch.Tensor:
        """The target's next-token logits [M, V] at hidden rows `rows_M` (of the selected draft rows,
        row-major), with ids it cannot produce (the mask token, the embedding's padding rows) at -inf."""
        b_M = torch.arange(sel_BN.shape[0], device=sel_BN.device)[:, None].expand_as(sel_BN)[sel_BN]
        features, weight, bias = out.head(out.hidden_BLE[b_M, rows_M])
        logits = F.linear(features, weight, bias).float()
        logits[:, self.ids.num_tokens :] = -math.inf
        logits[:, self.ids.mask_id] = -math.inf
        return logits

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        if self.cfg.loss == "ce":
            return weighted_ce(out, inputs, self.cross_entropy, self.ids.mask_id)
        assert isinstance(inputs, DraftInputs) and inputs.teacher_logits_MV is not None
        return kl_loss(out, inputs)


def kl_loss(out: ModelOutput, inputs: DraftInputs) -> LossOutput:
    """sum(w * KL(target || drafter)) over the supervised draft rows (the ids the target may not
    produce are excluded from both); the reported CE is the drafter's against the target's greedy token."""
    sel_BN = inputs.weights_BL > 0
    features, weight, bias = out.head(out.hidden_BLE[sel_BN])
    logits_MV = F.linear(features, weight, bias).float()
    # ids neither model may produce: a large finite negative (not -inf) keeps 0 * (logp - logq) finite
    teacher_MV = inputs.teacher_logits_MV.clamp_min(_NEVER)  # type: ignore[union-attr]
    logits_MV = torch.where(teacher_MV > _NEVER, logits_MV, torch.full_like(logits_MV, _NEVER))
    logp_MV, logq_MV = logits_MV.log_softmax(-1), teacher_MV.log_softmax(-1)
    kl_M = (logq_MV.exp() * (logq_MV - logp_MV)).sum(-1)
    loss_sum = (kl_M * inputs.weights_BL[sel_BN]).sum()
    ce_M = -logp_MV.detach().gather(1, inputs.targets_BL[sel_BN][:, None]).squeeze(1)
    return LossOutput(loss_sum, {"masked_ce_sum": ce_M.detach().sum(), "num_masked": sel_BN.sum()})
