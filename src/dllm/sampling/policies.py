"""Which masked positions to commit at a step. A policy never calls the model.

A policy gets the step's proposals (token, its probability, the runner-up's probability, the entropy
of the distribution) for the eligible positions and returns a bool commit mask:

- scheduled policies (low_confidence, random, margin, entropy) score positions and commit the k best,
  k from the block's schedule (LLaDA's semi-autoregressive remasking);
- threshold commits every position whose proposal has probability >= tau, and at least the most
  confident one per row (Fast-dLLM's confidence-aware parallel decoding);
- factor commits the n most confident positions with (n + 1) * (1 - p_n) < f, at least one
  (Fast-dLLM's factor-based rule: more tokens per step when the model is sure of many).

Shapes: B batch, R region (positions of the active block or sub-block).
"""

from __future__ import annotations

import torch

from dllm.registry import Registry
from dllm.sampling.proposals import Proposal

__all__ = ["POLICIES", "Proposal", "make_policy", "most_confident", "select_topk"]


class LowConfidence:
    """Commit the positions whose proposed token has the highest probability (LLaDA's default)."""

    scheduled = True

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return prop.prob_BR


class RandomOrder:
    """Commit random positions (the original masked-diffusion reverse process)."""

    scheduled = True

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return torch.rand(prop.prob_BR.shape, generator=generator, device=prop.prob_BR.device)


class Margin:
    """Commit the positions where the top-1 beats the top-2 probability by the most (Kim et al. 2025)."""

    scheduled = True

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return prop.margin_BR


class Entropy:
    """Commit the positions with the lowest predictive entropy (Dream's `entropy` remasking)."""

    scheduled = True

    def scores(self, prop: Proposal, generator: torch.Generator | None) -> torch.Tensor:
        return -prop.entropy_BR


class Threshold:
    """Every eligible position with p >= tau, and each row's most confident one."""

    scheduled = False

    def __init__(self, tau: float) -> None:
        self.tau = tau

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor) -> torch.Tensor:
        return (eligible_BR & (prop.prob_BR >= self.tau)) | most_confident(prop.prob_BR, eligible_BR)


class Factor:
    """The n most confident eligible positions with (n + 1) * (1 - p_n) < f (p sorted descending), n >= 1."""

    scheduled = False

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def commit(self, prop: Proposal, eligible_BR: torch.Tensor) -> torch.Tensor:
        probs = torch.where(eligible_BR, prop.prob_BR.double(), torch.zeros_like(prop.prob_BR, dtype=torch.float64))
        sorted_p, _ = probs.sort(dim=-1, descending=True, stable=True)
        n = torch.arange(1, probs.shape[-1] + 1, device=probs.device, dtype=torch.float64)
        ok = (n + 1) * (1 - sorted_p) < self.factor
        # the rule holds for a prefix of the sorted list (p_n only falls as n grows): count it
        prefix = ok.long().cumprod(dim=-1).sum(-1)
        k_B = prefix.clamp_min(1).minimum(eligible_BR.sum(-1))
        return select_topk(prop.prob_BR, eligible_BR, k_B)


POLICIES: Registry[type] = Registry("sampling policy")
POLICIES.add("low_confidence", LowConfidence)
POLICIES.add("random", RandomOrder)
POLICIES.add("margin", Margin)
POLICIES.add("entropy", Entropy)
POLICIES.add("threshold", Threshold)
POLICIES.add("factor", Factor)


def make_policy(name: str, threshold: float = 0.9, factor: float = 1.0):
    cls = POLICIES.get(name)
    if cls is Threshold:
        return Threshold(threshold)
    if cls is Factor:
        return Factor(factor)
    return cls()


def most_confident(prob_BR: torch.Tensor, eligible_BR: torch.Tensor) -> torch.Tensor:
    """Each row's single most probable eligible position (none for a row with nothing eligible)."""
    return select_topk(prob_BR, eligible_BR, torch.ones(prob_BR.shape[0], dtype=torch.long, device=prob_BR.device))


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
