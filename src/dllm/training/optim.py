"""Optimizer construction: AdamW with weight decay on weight matrices only."""

from __future__ import annotations

import torch
from torch import nn

from dllm.config.training import OptimizerConfig


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        # embeddings, norms and biases are not decayed (standard LLaMA/GPT practice)
        is_matrix = p.ndim >= 2 and "embed" not in name
        (decay if is_matrix else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False: the single-tensor path gives identical numbers for FSDP2 DTensors and plain tensors
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, foreach=False)
