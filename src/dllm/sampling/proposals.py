"""What the model proposes at each position of a region, and the even split of a block over its steps.

Shapes: B batch, R region (positions of the active block or sub-block), V vocabulary, S steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Proposal:
    """What the model proposes at each position of the region."""

    tokens_BR: torch.Tensor
    """The proposed token (argmax or a sample)."""
    prob_BR: torch.Tensor
    """Probability of the proposed token (float64)."""
    margin_BR: torch.Tensor
    """Top-1 minus top-2 probability (float64)."""
    entropy_BR: torch.Tensor
    """Entropy of the predicted distribution in nats (float64)."""


def commit_schedule(num_masked_B: torch.Tensor, steps: int) -> torch.Tensor:
    """[B, steps] tokens to commit per step: an even split, the remainder to the first steps."""
    base = torch.div(num_masked_B, steps, rounding_mode="floor")
    rem = num_masked_B % steps
    sched = base[:, None].expand(-1, steps).clone()
    sched += (torch.arange(steps, device=num_masked_B.device)[None, :] < rem[:, None]).long()
    return sched


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits outside the top-k / nucleus set to -inf (the most probable token always stays)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p  # mass before this token already >= p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def full_proposal(
    logits_BRV: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Proposal:
    """The proposed token per position with its probability, margin and entropy under the model.

    With temperature > 0 the token is argmax(logits / T + Gumbel) in float64 over the top-k / top-p
    set: low-precision Gumbel noise measurably biases sampling (LLaDA, appendix B.4)."""
    logits = logits_BRV.double()
    if temperature > 0:
        filtered = filter_logits(logits, top_k, top_p)
        u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
        tokens = (filtered / temperature + gumbel).argmax(-1)
    else:
        tokens = logits.argmax(-1)
    probs = torch.softmax(logits, dim=-1)
    top2 = probs.topk(min(2, probs.shape[-1]), dim=-1).values
    margin = top2[..., 0] - (top2[..., 1] if top2.shape[-1] > 1 else 0)
    entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
    return Proposal(tokens, probs.gather(-1, tokens[..., None]).squeeze(-1), margin, entropy)


def propose(
    logits_BRV: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    top_k: int | None = None,
    top_p: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token, its probability) per position: the two fields of `full_proposal` most callers need."""
    prop = full_proposal(logits_BRV, temperature, generator, top_k, top_p)
    return prop.tokens_BR, prop.prob_BR


def token_probs(logits_XV: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """The sampling distribution (float64) of causal decoding: top-k / top-p on the logits, then the
    temperature, as `full_proposal` samples (temperature > 0)."""
    return torch.softmax(filter_logits(logits_XV.double(), top_k, top_p) / temperature, dim=-1)


def draw(probs_XV: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of a (not necessarily normalised) distribution, by inverting its CDF with one
    seeded uniform per row; a zero-probability token is never drawn. (Speculative verification needs the
    probabilities themselves, so causal decoding draws from them rather than by Gumbel-max.)"""
    cdf_XV = probs_XV.cumsum(-1)
    u_X1 = torch.rand(cdf_XV.shape[:-1], generator=generator, device=cdf_XV.device, dtype=cdf_XV.dtype)[..., None]
    return torch.searchsorted(cdf_XV, u_X1 * cdf_XV[..., -1:], right=True).squeeze(-1).clamp_max(cdf_XV.shape[-1] - 1)
