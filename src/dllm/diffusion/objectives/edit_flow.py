"""Edit Flows (Havasi et al. 2025, "Edit Flows: Flow Matching with Edit Operations").

Generation is a continuous-time Markov chain over sequences whose moves are single-token edits:
insert a token after position i, delete i, substitute i. Training uses the auxiliary aligned space:
x_0 and x_1 are aligned (diffusion/edit_alignment.py: an optimal Levenshtein alignment z_0, z_1
with gaps), each aligned column shows its x_1 side with probability kappa(t) and its x_0 side
otherwise (z_t), and x_t is z_t without gaps. The loss is the Bregman-divergence flow-matching loss
(the paper's training objective over the aligned space) with the scheduler factored out of the rate,
as time-agnostic MDLM factors 1/t out of its denoiser: the rate the sampler uses is
u(x_t, t) = w(t) * lambda(x_t), w(t) = kappa'(t) / (1 - kappa(t)) (diffusion/edit_schedule.py), and
the network gives the time-free lambda (the model contract has no t): the intensity of the edits
still to do at each position, which it reads off x_t itself. Per row,

    L = w(t) * [ sum_{positions} sum_{kinds} lambda  -  sum_{remaining edits} log lambda(edit) ]

where a remaining edit is a column with z_t != z_1, and lambda(edit) is lambda_ins(i) Q_ins(i, b)
for an insertion of b after x_t position i, lambda_del(i) for a deletion, lambda_sub(i) Q_sub(i, b)
for a substitution. Substituting u = w * lambda into the paper's loss
sum u - w * sum log u gives this plus -w(t) * (number of remaining edits) * log w(t), which does not
depend on the parameters and is dropped (so the loss can be negative or positive like before, and
its minimiser is unchanged). The loss is the expectation over t ~ U[0, 1 - eps]; it is estimated
(stratified over the global batch) either with t drawn uniformly and each row weighted by w(t)
(`time_sampling: uniform`, the paper's), or with t drawn in proportion to w(t) (`time_sampling:
weight`: K(t) = -log(1 - kappa(t)) uniform on [0, K(1 - eps)], every row weighted by
K(1 - eps) / (1 - eps)). Both are unbiased for the same loss. The second has no weight variance,
but most of its rows are close to x_1 and carry few remaining edits; in one short comparison on the
editflow-smoke sums (cubic kappa, 600 steps) it did not help (neither run learnt the sums), and with
linear kappa the uniform estimator already weighs each remaining edit's log term by
w(t) (1 - kappa) = kappa' = 1.

Choices, stated once here:
- x_0 of the completion: empty (`x0: empty`, every edit is an insertion) or uniform random tokens as
  long as x_1 (`x0: uniform`, the paper's other source; insertions, deletions and substitutions).
- A row is `[anchor] + prompt + x_t`; the anchor (the mask id, otherwise unused by edit flows) gives
  an insertion at the very start of the sequence a position to come from, also with an empty prompt.
  The prompt (unsupervised tokens before the first supervised one) is never edited: its positions
  carry no rates except the insertion rate of the last prefix token (inserting at the completion's
  start). The supervised tokens of the row, in order, are x_1; packed rows with several documents
  are edited as one sequence.
- Rows have different lengths after editing; they are padded with the pad id and the padding is
  masked out of attention (`key_valid_BL`) and out of the loss.
- The loss is normalised by the global count of supervised tokens (the x_1 tokens), like the others.

Shapes: B batch, L input length, A alignment columns, N edits (flattened), E hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dllm.attention.masks import AttentionMask
from dllm.config.objectives import EditFlowConfig
from dllm.data.loader import Batch
from dllm.diffusion.corruption import NoiseKeys, uniform_token_ids
from dllm.diffusion.edit_alignment import GAP, align
from dllm.diffusion.edit_schedule import cumulative_weight, kappa_and_weight, time_of_weight
from dllm.diffusion.objectives.base import LossOutput, ModelInputs, TokenIds
from dllm.models.edit_flow import DELETE, INSERT, SUBSTITUTE, edit_token_log_probs
from dllm.models.output import ModelOutput


@dataclass(frozen=True, kw_only=True)
class EditFlowInputs(ModelInputs):
    """ModelInputs plus what the edit-flow loss needs (the remaining edits of each row)."""

    rate_on_BL3: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """1 where a rate (insert-after, delete, substitute) belongs to the sequence's edit set, else 0."""
    edit_row_N: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """Row of each remaining edit."""
    edit_pos_N: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """Input position of each edit (the token deleted / substituted, or the one an insertion follows)."""
    edit_kind_N: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """INSERT, DELETE or SUBSTITUTE (models/edit_flow.py)."""
    edit_token_N: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """Token inserted or substituted (0 for a deletion: unused)."""
    edit_weight_N: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """The loss weight of the edit's row (`row_weight_B`)."""
    row_weight_B: torch.Tensor = field(default=None)  # type: ignore[assignment]
    """Loss weight of each row: w(t), or K(1 - eps) / (1 - eps) under time_sampling weight."""


class EditFlowObjective:
    def __init__(
        self, cfg: EditFlowConfig, ids: TokenIds, chunked_loss: bool = True, shift_logits: bool = False
    ) -> None:
        assert not shift_logits, "config rules refuse model.shift_logits with this objective"
        self.cfg, self.ids = cfg, ids

    def normalizer(self, batch: Batch) -> int:
        return batch.num_targets

    def prepare(self, batch: Batch, noise: NoiseKeys) -> EditFlowInputs:
        x, sup = batch.tokens_BL, batch.loss_mask_BL
        B, L = x.shape
        sids = batch.sample_ids_B
        prompt_B = sup.long().argmax(-1)  # a row without supervision (padding) is one anchor, never edited
        len1_B = sup.sum(-1)
        x1_BL = x.gather(1, torch.sort((~sup).long(), dim=1, stable=True).indices)  # supervised tokens first
        if self.cfg.x0 == "uniform":
            u_BL = noise.uniform(sids, (L,), "edit_flow.x0")
            x0_BN, len0_B = uniform_token_ids(u_BL, self.ids.num_tokens, self.ids.mask_id), len1_B
        else:
            x0_BN, len0_B = x.new_zeros(B, 0), torch.zeros_like(len1_B)
        z0_BA, z1_BA, _ = align(x0_BN, len0_B, x1_BL, len1_B)
        A = z0_BA.shape[1]
        u_B = noise.stratified_time(sids, "edit_flow.t", self.cfg.antithetic)
        t_max = 1.0 - self.cfg.eps
        if self.cfg.time_sampling == "weight":  # K(t) uniform: density w(t) / K(t_max), weight K(t_max) / t_max
            K_max = cumulative_weight(self.cfg.kappa, t_max)
            t_B = time_of_weight(self.cfg.kappa, u_B.double() * K_max).to(u_B.dtype).clamp_max(t_max)
            kappa_B, w_B = kappa_and_weight(self.cfg.kappa, t_B)[0], torch.full_like(t_B, K_max / t_max)
        else:
            t_B = u_B * t_max
            kappa_B, w_B = kappa_and_weight(self.cfg.kappa, t_B)
        keep_BA = noise.uniform(sids, (2 * L,), "edit_flow.keep")[:, :A] < kappa_B[:, None]
        zt_BA = torch.where(keep_BA, z1_BA, z0_BA)
        return self._inputs(x, prompt_B, zt_BA, z1_BA, w_B)

    def _inputs(self, x_BL, prompt_B, zt_BA, z1_BA, w_B) -> EditFlowInputs:
        """Rows [anchor] + prompt + x_t padded to the longest, their rate mask and remaining edits."""
        B, dev = x_BL.shape[0], x_BL.device
        prefix_B = 1 + prompt_B  # anchor + prompt
        tok_BA = zt_BA >= 0
        rows_B = prefix_B + tok_BA.sum(-1)
        Li = int(rows_B.max())
        col_BL = torch.arange(Li, device=dev).expand(B, Li)
        tokens = torch.full((B, Li), self.ids.pad_id, dtype=torch.long, device=dev)
        tokens[:, 0] = self.ids.mask_id
        in_prompt = (col_BL >= 1) & (col_BL < prefix_B[:, None])
        tokens[in_prompt] = x_BL.gather(1, (col_BL - 1).clamp(0, x_BL.shape[1] - 1))[in_prompt]
        before_BA = tok_BA.long().cumsum(-1) - tok_BA.long()  # x_t tokens left of each column
        dest_BA = prefix_B[:, None] + before_BA
        r, c = tok_BA.nonzero(as_tuple=True)
        tokens[r, dest_BA[r, c]] = zt_BA[r, c]
        valid_BL = col_BL < rows_B[:, None]
        rate_on = torch.zeros(B, Li, 3, device=dev)
        rate_on[..., INSERT] = ((col_BL >= prefix_B[:, None] - 1) & valid_BL).float()
        editable = ((col_BL >= prefix_B[:, None]) & valid_BL).float()
        rate_on[..., DELETE], rate_on[..., SUBSTITUTE] = editable, editable
        rate_on *= (z1_BA >= 0).any(-1).float()[:, None, None]  # no completion: nothing to learn
        # remaining edits: columns where z_t still differs from z_1 (Havasi et al. 2025, the aligned-space loss)
        ins = (zt_BA == GAP) & (z1_BA >= 0)
        dele = (zt_BA >= 0) & (z1_BA == GAP)
        sub = (zt_BA >= 0) & (z1_BA >= 0) & (zt_BA != z1_BA)
        kind_BA = torch.where(ins, INSERT, torch.where(dele, DELETE, SUBSTITUTE))
        pos_BA = torch.where(ins, dest_BA - 1, dest_BA)  # an insertion follows the previous token
        r, c = (ins | dele | sub).nonzero(as_tuple=True)
        mask = AttentionMask("bidirectional", key_valid_BL=valid_BL)
        return EditFlowInputs(
            tokens, col_BL, mask, tokens, rate_on.amax(-1),
            rate_on_BL3=rate_on, edit_row_N=r, edit_pos_N=pos_BA[r, c], edit_kind_N=kind_BA[r, c],
            edit_token_N=z1_BA[r, c].clamp_min(0), edit_weight_N=w_B[r], row_weight_B=w_B,
        )  # fmt: skip

    def loss(self, out: ModelOutput, inputs: ModelInputs) -> LossOutput:
        assert isinstance(inputs, EditFlowInputs) and out.edit is not None, "edit_flow needs model.edit_head"
        rates_BL3, ins_features_BLE = out.edit(out.hidden_BLE)
        on_BL3 = inputs.rate_on_BL3.to(rates_BL3.dtype)
        rate_sum = (rates_BL3 * on_BL3 * inputs.row_weight_B.to(rates_BL3.dtype)[:, None, None]).sum()
        r, p, k = inputs.edit_row_N, inputs.edit_pos_N, inputs.edit_kind_N
        log_rate_N = rates_BL3[r, p, k].clamp_min(1e-30).log()
        features_NE = torch.where((k == INSERT)[:, None], ins_features_BLE[r, p], out.hidden_BLE[r, p])
        log_q_NV = edit_token_log_probs(out.head, features_NE, self.ids.num_tokens, self.ids.mask_id)
        log_q_N = log_q_NV.gather(1, inputs.edit_token_N[:, None])[:, 0]
        log_u_N = log_rate_N + torch.where(k == DELETE, torch.zeros_like(log_q_N), log_q_N.to(log_rate_N.dtype))
        edit_term = (inputs.edit_weight_N.to(log_u_N.dtype) * log_u_N).sum()
        metrics = {
            "rate_sum": (rates_BL3 * on_BL3).sum().detach(),
            "num_edits": torch.tensor(r.numel(), device=r.device),
        }
        return LossOutput(loss_sum=rate_sum - edit_term, metrics=metrics)
