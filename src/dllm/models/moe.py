"""Mixture-of-experts layers: the routers and the experts they send tokens to.

One MoE layer computes every routing the families need: softmax over experts then top-k (Qwen3-MoE,
OLMoE, LLaDA-MoE), or an independent sigmoid per expert with a selection-only expert bias, expert
groups (a token may use only the `router_topk_groups` groups of best top-2 score sum) and a scale
on the weights (LLaDA2, after DeepSeek-V3, Liu et al. 2024); shared experts see every token, their
output scaled per token by a sigmoid gate where the family has one (Qwen3-Next, Qwen3.5-MoE).

Shapes: B batch, L sequence, E hidden width, N tokens (flattened), X experts, K experts per token,
G expert groups.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dllm.config.model import ModelConfig
from dllm.config.registries import ACTIVATIONS


class Experts(nn.Module):
    """X gated experts stored as 3-D tensors (the transformers 5 Qwen3-MoE layout)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        X, E, inner = cfg.num_experts, cfg.hidden_size, cfg.expert_size
        self.gate_up_proj = nn.Parameter(torch.empty(X, 2 * inner, E))
        self.down_proj = nn.Parameter(torch.empty(X, E, inner))
        self.act = ACTIVATIONS.resolve(cfg.activation)

    def forward(self, x_NE: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        out_NE = torch.zeros_like(x_NE)
        for x in experts_NK.unique().tolist():  # only the experts some token was routed to
            token, slot = torch.where(experts_NK == x)
            gate, up = F.linear(x_NE[token], self.gate_up_proj[x]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down_proj[x]) * weights_NK[token, slot, None]
            out_NE.index_add_(0, token, y.to(out_NE.dtype))
        return out_NE


class MoE(nn.Module):
    """Routed experts (+ shared experts); returns the output and the Switch Transformer
    load-balancing loss (Fedus et al. 2021, eq. 4-6) over the routing distribution."""

    def __init__(self, cfg: ModelConfig, mlp: Callable[[ModelConfig, int], nn.Module]) -> None:
        super().__init__()
        self.top_k, self.num_experts, self.norm_topk = cfg.num_experts_per_tok, cfg.num_experts, cfg.norm_topk_prob
        self.sigmoid, self.scale = cfg.router_score == "sigmoid", cfg.routed_scaling_factor
        self.groups, self.topk_groups = cfg.router_groups, cfg.router_topk_groups
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        bias = torch.zeros(cfg.num_experts) if cfg.router_expert_bias else None
        self.register_buffer("expert_bias", bias)  # set by load-balancing outside the gradient (checkpointed)
        self.experts = Experts(cfg)
        shared = cfg.num_shared_experts * cfg.expert_size
        self.shared_experts = mlp(cfg, shared) if shared else None
        # Qwen3.5-MoE: a per-token scalar gate on the shared experts' output
        self.shared_expert_gate = (
            nn.Linear(cfg.hidden_size, 1, bias=False) if shared and cfg.shared_expert_gate else None
        )

    def forward(self, x_BLE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_NE = x_BLE.reshape(-1, x_BLE.shape[-1])
        top_w, top_i, probs_NX = self.route(x_NE)
        routed_X = F.one_hot(top_i, self.num_experts).float().sum(1).mean(0) / self.top_k
        aux_loss = self.num_experts * (routed_X * probs_NX.mean(0)).sum()
        out_NE = self.experts(x_NE, top_i, top_w.to(x_NE.dtype))
        if self.shared_experts is not None:
            shared_NE = self.shared_experts(x_NE)
            if self.shared_expert_gate is not None:
                shared_NE = torch.sigmoid(self.shared_expert_gate(x_NE)) * shared_NE
            out_NE = out_NE + shared_NE
        return out_NE.view_as(x_BLE), aux_loss

    def route(self, x_NE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(weights [N, K], experts [N, K], routing distribution [N, X]), computed in float32."""
        if not self.sigmoid:
            probs_NX = torch.softmax(self.gate(x_NE).float(), dim=-1)
            top_p, top_i = self.select(probs_NX).topk(self.top_k, dim=-1)
            if self.norm_topk:
                top_p = top_p / top_p.sum(-1, keepdim=True)
            return top_p, top_i, probs_NX
        scores_NX = torch.sigmoid(F.linear(x_NE.float(), self.gate.weight.float()))
        biased_NX = scores_NX if self.expert_bias is None else scores_NX + self.expert_bias.float()
        top_i = self.select(biased_NX).topk(self.top_k, dim=-1)[1]
        top_w = scores_NX.gather(1, top_i)  # the bias chooses experts; the weights are the plain scores
        if self.norm_topk and self.top_k > 1:
            top_w = top_w / (top_w.sum(-1, keepdim=True) + 1e-20)
        return top_w * self.scale, top_i, scores_NX / scores_NX.sum(-1, keepdim=True)

    def select(self, scores_NX: torch.Tensor) -> torch.Tensor:
        """Scores with the experts outside each token's best `topk_groups` groups at -inf."""
        if self.groups == 1:
            return scores_NX
        N, G = scores_NX.shape[0], self.groups
        group_NG = scores_NX.view(N, G, -1).topk(2, dim=-1)[0].sum(-1)
        keep_NG = torch.zeros_like(group_NG, dtype=torch.bool)
        keep_NG.scatter_(1, group_NG.topk(self.topk_groups, dim=-1)[1], True)
        keep_NX = keep_NG[:, :, None].expand(N, G, self.num_experts // G).reshape(N, -1)
        return scores_NX.masked_fill(~keep_NX, float("-inf"))
