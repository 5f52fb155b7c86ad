"""The pieces of Gemma 4 blocks that other families do not have (DiffusionGemma's layout).

A Gemma 4 MoE block runs routed experts beside its dense MLP, each branch with its own output norm
(`BesideDenseExperts`); its router normalises its input without a learned scale, then multiplies a
learned per-feature scale and 1/sqrt(E), and weights each chosen expert by a learned per-expert scale
(`GemmaRouter`). DiffusionGemma adds the previous denoising step's soft embedding to the canvas rows
through a gated MLP (`CanvasConditioning`). The block stack itself is models/transformer.py's.

Shapes: B batch, L sequence, C canvas rows, E hidden width, V vocabulary, N tokens (flattened),
X experts, K experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dllm.config.model import ModelConfig
from dllm.config.registries import ACTIVATIONS, NORMS
from dllm.models.output import CanvasConditioned

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a learned scale, in float32 (Gemma 4's value, router and canvas norms)."""
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class GemmaRouter(nn.Module):
    """Top-k routing of Gemma 4: softmax over experts of a scaled, normalised input; the top-k
    probabilities renormalised to 1, then multiplied by each chosen expert's learned scale."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.eps = cfg.num_experts_per_tok, cfg.norm_eps
        self.proj = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.num_experts))

    def forward(self, x_NE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities [N, X] in float32, chosen experts [N, K], their weights [N, K])."""
        h = rms_normalize(x_NE, self.eps) * self.scale / math.sqrt(x_NE.shape[-1])
        probs_NX = torch.softmax(self.proj(h).float(), dim=-1)
        top_p, top_i = probs_NX.topk(self.top_k, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True) * self.per_expert_scale[top_i]
        return probs_NX, top_i, top_p


class BesideDenseExperts(nn.Module):
    """Gemma 4's second feed-forward branch: experts read the normalised residual stream, routed from the
    raw one; the dense MLP's output and theirs are each normalised, then summed."""

    def __init__(self, cfg: ModelConfig, experts: nn.Module, make_norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.router = GemmaRouter(cfg)
        self.experts = experts
        self.dense_out_norm, self.experts_in_norm, self.experts_out_norm = make_norm(), make_norm(), make_norm()

    def forward(self, dense_BLE: torch.Tensor, x_BLE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The summed branches for the dense MLP's output and the residual stream x, and the Switch
        Transformer load-balancing loss of the routing (Fedus et al. 2021, eq. 4-6)."""
        x_NE = x_BLE.reshape(-1, x_BLE.shape[-1])
        probs_NX, top_i, top_p = self.router(x_NE)
        routed_NE = self.experts(self.experts_in_norm(x_NE), top_i, top_p.to(x_NE.dtype))
        out = self.dense_out_norm(dense_BLE) + self.experts_out_norm(routed_NE.view_as(x_BLE))
        routed_X = F.one_hot(top_i, self.num_experts).float().sum(1).mean(0) / self.top_k
        return out, self.num_experts * (routed_X * probs_NX.mean(0)).sum()


class CanvasConditioning(nn.Module):
    """DiffusionGemma's self-conditioning: canvas embedding + gated MLP(norm(soft embedding of the previous
    step's logits)), RMS-normalised without a scale. Without previous logits the soft embedding is zero,
    so the first step's canvas rows are only normalised."""

    def __init__(self, cfg: ModelConfig, make_norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        E, inner = cfg.hidden_size, cfg.mlp_size
        self.eps = cfg.norm_eps
        self.pre_norm = make_norm()
        self.gate_proj = nn.Linear(E, inner, bias=False)
        self.up_proj = nn.Linear(E, inner, bias=False)
        self.down_proj = nn.Linear(inner, E, bias=False)
        self.act = ACTIVATIONS.resolve(cfg.activation)

    def forward(
        self, canvas_BCE: torch.Tensor, previous: CanvasConditioned | None, weight_VE: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """The canvas rows' input; `previous` holds the previous step's logits, whose expected token
        embedding (`weight_VE` times the model's embedding `scale`) is the soft embedding."""
        if previous is not None:
            probs_BCV = torch.softmax(previous.logits_BCV.float(), dim=-1).to(weight_VE.dtype)
            soft_BCE = (probs_BCV @ weight_VE) * weight_VE.new_tensor(scale)
            if previous.on_B is not None:  # examples without self-conditioning get a zero signal
                soft_BCE = soft_BCE * previous.on_B.to(soft_BCE.dtype)[:, None, None]
            h = self.pre_norm(soft_BCE)
            canvas_BCE = canvas_BCE + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))
        return rms_normalize(canvas_BCE, self.eps)


def fresh_canvas_conditioning(cfg: ModelConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A new self-conditioning block's weights (a Gemma 4 checkpoint converted to DiffusionGemma has none): its
    norm 1, gate and up Normal(0, init_std), down 0, so the block starts as a no-op whose down projection
    trains first (as the zero-initialised self-conditioning projection of `Transformer.init_weights`)."""
    E, inner, std = cfg.hidden_size, cfg.mlp_size, cfg.init_std
    block = CanvasConditioning(cfg, lambda: NORMS.resolve(cfg.norm).of(cfg, E))
    state = {k: v.detach().clone() for k, v in block.state_dict().items()}
    for name in ("gate_proj.weight", "up_proj.weight"):
        state[name] = torch.randn(inner, E, generator=generator) * std
    state["down_proj.weight"] = torch.zeros(E, inner)
    return state


def freeze_routers(model: nn.Module) -> None:
    """Keep every Gemma router's weights and scales as they are (an objective that trains the rest)."""
    for module in model.modules():
        if isinstance(module, GemmaRouter):
            module.requires_grad_(False)
