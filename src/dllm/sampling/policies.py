"""Remasking policies: which masked positions to commit at a step. A policy never calls the model.

A policy scores candidate positions; `select_topk` commits the k best eligible ones per row.
"""

from __future__ import annotations

import torch

from dllm.registry import Registry


class LowConfidence:
    """Commit the positions whose proposed token has the highest probability (LLaDA's default)."""

    def scores(self, probs_x0_BL: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return probs_x0_BL


class RandomOrder:
    """Commit random positions (the original masked-diffusion reverse process)."""

    def scores(self, probs_x0_BL: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        return torch.rand(probs_x0_BL.shape, generator=generator, device=probs_x0_BL.device)


POLICIES: Registry[type] = Registry("sampling policy")
POLICIES.add("low_confidence", LowConfidence)
POLICIES.add("random", RandomOrder)


def select_topk(scores_BL: torch.Tensor, eligible_BL: torch.Tensor, k_B: torch.Tensor) -> torch.Tensor:
    """Bool [B, L]: the k_B[b] highest-scoring eligible positions of each row."""
    # eligible scores stay finite (even a -inf score), so they always rank above ineligible positions
    floor = torch.finfo(torch.float64).min
    finite = scores_BL.double().nan_to_num(nan=floor, neginf=floor)
    masked = torch.where(eligible_BL, finite, torch.tensor(float("-inf"), dtype=torch.float64))
    order = masked.argsort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return (rank < k_B[:, None]) & eligible_BL
