"""DFlash2 drafters: DFlash blocks with grouped dynamic causal convolutions and a candidate selector.

What the public code computes (z-lab's DFlash2DraftModel, dflash 0.1.0; this module is written from its
math, not its code), on top of the DFlash drafter (models/dflash.py, architecture dflash):
- convolutions: each block has two (`attention_conv` around attention, `mlp_conv` around the MLP). A
  convolution's `kernel_projection` maps the block's normed input x (after input_layernorm or
  post_attention_layernorm) to dynamic kernels [2, k, G] per row (k taps, G = E / group_size channel groups);
  `prepare` convolves x with the first (plus `base_kernel[0]`, one weight per tap and channel) before the
  sublayer, `finish` convolves the sublayer's output with the second (plus `base_kernel[1]`) before the
  residual add:  y[l, c] = sum_o (base[o, c] + dynamic[l, o, c // group_size]) * x[l - o, c],  the kernel of
  row l (not of l - o), causal and zero before the first row of the draft block. Only the draft block's rows
  are convolved: the fused target context goes into the keys and values as in DFlash. In a training forward
  with many blocks per row each block is convolved on its own (rows of other blocks are never mixed in).
- logits: the target's LM head, times `output_multiplier`, then c * tanh(logits / c) for
  `final_logit_softcapping` c (DFlash's public config has both too; dllm applies them for either).
- the candidate selector, used at decoding time only (the reference's propose, called by its generation loop in
  place of the per-position argmax or draw): each of the b - 1 draft positions keeps its top_k tokens by draft
  logit; walking the positions left to right from the anchor, the score of candidate t after the previous
  token p is  logit(t) + sum_r predecessor_codebook[p, r] * hidden_projection(h)[r] * successor_codebook[t, r]
  (h: the drafter's final state at that position); greedy takes the best, temperature T > 0 draws from
  softmax(score / T) over the candidates, and that distribution (0 outside the candidates) is the q of the
  speculative rejection rule. So a draft is a chain, not b - 1 independent choices (`select_drafts`, which the
  causal loop calls in place of its own argmax or draw; sampling/speculative.py). The sampler's top_k and
  top_p shape the target's distribution p only, not q (as in the reference). One difference: dllm's loop sets
  the MASK token's logit to -inf first (as for DFlash drafters), so MASK is never a candidate.
- sliding-window and causal draft blocks (public `layer_types`, `sliding_window`, `is_causal`) are DFlash's
  (models/dflash.py: `layer_sees`), for either version.

Not here: training. The public package holds the architecture and its decoding, no training objective or
loss for the convolutions or the selector, so dllm trains DFlash (v1) drafters only (objective
dflash_distillation, architecture dllm or dflash) and loads, decodes with and writes DFlash2 drafters in the
public layout (models/dflash_io.py).

Shapes: B batch, L rows (A blocks x b), b block size, d drafts (b - 1), E hidden, k taps, G channel groups,
K candidates (top_k), R selector rank, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dllm.config.drafter import DFlashConfig
from dllm.models.dflash import DFlashDrafter, DraftState


def dynamic_causal_conv(x_BLE: torch.Tensor, dynamic_BLkG: torch.Tensor, base_kE: torch.Tensor, b: int) -> torch.Tensor:
    """y[l] = sum_o (base[o] + dynamic[l, o] per channel group) * x[l - o], inside each block of b rows."""
    B, L, E = x_BLE.shape
    k, G = dynamic_BLkG.shape[-2:]
    kernel_BLkE = base_kE.to(x_BLE.dtype) + dynamic_BLkG.repeat_interleave(E // G, dim=-1)
    x_BAbE = x_BLE.view(B, L // b, b, E)
    kernel_BAbkE = kernel_BLkE.view(B, L // b, b, k, E)
    y_BAbE = kernel_BAbkE[:, :, :, 0] * x_BAbE
    for o in range(1, min(k, b)):  # tap o reads the row o before (zero before the block's first row)
        shifted_BAbE = F.pad(x_BAbE[:, :, : b - o], (0, 0, o, 0))
        y_BAbE = y_BAbE + kernel_BAbkE[:, :, :, o] * shifted_BAbE
    return y_BAbE.view(B, L, E)


class DynamicCausalConv(nn.Module):
    """A grouped dynamic causal convolution pair: `prepare` before a sublayer, `finish` after it."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.num_groups = kernel_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)

    def prepare(self, x_BLE: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x convolved with the first kernels, the second kernels [B, L, k, G] for `finish`)."""
        B, L, _ = x_BLE.shape
        dynamic_BL2kG = self.kernel_projection(x_BLE).view(B, L, 2, self.kernel_size, self.num_groups)
        return dynamic_causal_conv(x_BLE, dynamic_BL2kG[:, :, 0], self.base_kernel[0], b), dynamic_BL2kG[:, :, 1]

    def finish(self, y_BLE: torch.Tensor, dynamic_BLkG: torch.Tensor, b: int) -> torch.Tensor:
        return dynamic_causal_conv(y_BLE, dynamic_BLkG, self.base_kernel[1], b)


class CandidateSelector(nn.Module):
    """Picks a chain of drafts through each position's top-k candidates (module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def select(
        self,
        hidden_BdE: torch.Tensor,
        logits_BdV: torch.Tensor,
        anchor_B: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(drafts [B, d], and when sampling their distributions q [B, d, V], 0 outside the candidates)."""
        unary_BdK, candidates_BdK = logits_BdV.topk(min(self.top_k, logits_BdV.shape[-1]), dim=-1)
        h_BdR = self.hidden_projection(hidden_BdE.to(self.hidden_projection.weight.dtype))
        previous_B, drafts, q_rows = anchor_B, [], []
        for i in range(logits_BdV.shape[1]):
            left_BR = self.predecessor_codebook[previous_B] * h_BdR[:, i]
            edge_BK = torch.einsum("br,bkr->bk", left_BR, self.successor_codebook[candidates_BdK[:, i]])
            score_BK = unary_BdK[:, i] + edge_BK.to(unary_BdK.dtype)
            if temperature > 0:
                q_BK = torch.softmax(score_BK.to(torch.promote_types(score_BK.dtype, torch.float32)) / temperature, -1)
                pick_B = torch.multinomial(q_BK, 1, generator=generator)[:, 0]
                q_rows.append(q_BK)
            else:
                pick_B = score_BK.argmax(-1)
            previous_B = candidates_BdK[:, i].gather(1, pick_B[:, None])[:, 0]
            drafts.append(previous_B)
        drafts_Bd = torch.stack(drafts, dim=1)
        if not q_rows:
            return drafts_Bd, None
        q_BdK = torch.stack(q_rows, dim=1)
        return drafts_Bd, q_BdK.new_zeros(logits_BdV.shape).scatter_(-1, candidates_BdK, q_BdK)


class DFlash2Drafter(DFlashDrafter):
    """A DFlash drafter (architecture dflash) with a convolution pair in every block and a candidate selector."""

    def __init__(self, cfg: DFlashConfig) -> None:
        assert cfg.conv is not None and cfg.selector is not None, "architecture dflash2 sets conv and selector"
        super().__init__(cfg)
        E, k, group = self.cfg.hidden_size, cfg.conv.kernel_size, cfg.conv.group_size
        for layer in self.layers:  # named as the public layout names them: layers.N.{attention,mlp}_conv
            layer.attention_conv = DynamicCausalConv(E, k, group)
            layer.mlp_conv = DynamicCausalConv(E, k, group)
        assert cfg.target.vocab_size is not None
        self.candidate_selector = CandidateSelector(E, cfg.target.vocab_size, cfg.selector.rank, cfg.selector.top_k)

    def _train_layer(self, layer: nn.Module, x_BLE: torch.Tensor, rope, mask, kv) -> torch.Tensor:
        return self._conv_block(layer, x_BLE, None, rope, mask, kv)

    def _draft_layer(self, layer: nn.Module, x_BbE: torch.Tensor, context_BNE: torch.Tensor | None, rope, mask,
                     kv) -> torch.Tensor:  # fmt: skip
        return self._conv_block(layer, x_BbE, context_BNE, rope, mask, kv)

    def _conv_block(self, layer: nn.Module, x_BLE: torch.Tensor, context_BNE: torch.Tensor | None, rope, mask,
                    kv) -> torch.Tensor:  # fmt: skip
        """One block over the draft rows x (queries; blocks of b rows) and the new context rows (keys and values
        only, as they are: no norm, no convolution): conv, attention, conv, residual; conv, MLP, conv, residual."""
        b, Q = self.block_size, x_BLE.shape[1]
        h_BLE, dynamic = layer.attention_conv.prepare(layer.input_layernorm(x_BLE), b)
        rows = h_BLE if context_BNE is None else torch.cat([h_BLE, context_BNE], dim=1)
        x_BLE = x_BLE + layer.attention_conv.finish(layer.self_attn(rows, rope, mask, Q, kv), dynamic, b)
        h_BLE, dynamic = layer.mlp_conv.prepare(layer.post_attention_layernorm(x_BLE), b)
        return x_BLE + layer.mlp_conv.finish(layer.mlp(h_BLE), dynamic, b)

    @torch.no_grad()
    def select_drafts(
        self,
        state: DraftState,
        logits_BdV: torch.Tensor,
        anchor_B: torch.Tensor,
        temperature: float,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts of the last `propose` (its first d = logits_BdV.shape[1] positions) picked by the selector
        from those logits and the final states `propose` kept; and their distributions q when sampling."""
        assert state.hidden_BdE is not None, "propose before select_drafts"
        hidden_BdE = state.hidden_BdE[:, : logits_BdV.shape[1]]
        return self.candidate_selector.select(hidden_BdE, logits_BdV, anchor_B, temperature, generator)


def build_drafter(cfg: DFlashConfig) -> DFlashDrafter:
    """The drafter module of an architecture: DFlash2Drafter for dflash2, else DFlashDrafter."""
    return DFlash2Drafter(cfg) if cfg.architecture == "dflash2" else DFlashDrafter(cfg)
