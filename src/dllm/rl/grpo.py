"""GRPO for diffusion policies: group-normalised advantages and the clipped surrogate loss with a KL penalty.

Group Relative Policy Optimisation (DeepSeekMath, Shao et al. 2024, eq. 3), as diffu-GRPO uses it (d1,
Zhao et al. 2025, eq. 4): for each prompt G completions o_1..o_G are sampled from the old policy and
scored; completion i's advantage is its reward normalised inside its group,
A_i = (r_i - mean(r)) / (std(r) + eps), shared by all its tokens. Each of the mu inner updates per
generation round maximises

    J = 1/G sum_i 1/|o_i| sum_t [ min(rho_it A_i, clip(rho_it, 1 - eps_c, 1 + eps_c) A_i) - beta KL_it ],

rho_it = exp(logp_it - logp_old_it), and KL_it the k3 estimator of KL(pi || pi_ref) (Schulman 2020),
exp(ref_it - logp_it) - (ref_it - logp_it) - 1: unbiased, non-negative, low variance. The loss is -J.
With a fresh prompt mask per inner update (rl/logprob.py), logp_old and ref of update k are estimated
under update k's mask too (before the first update), so each ratio compares one estimator with itself.

Normalisation: per sequence (the mean over its completion tokens, `mask_BC`), then the mean over the
sequences of the batch, as written in DeepSeekMath and d1. It weighs short and long completions alike
per sequence (a known length bias; "Dr. GRPO", Liu et al. 2025, drops the 1/|o_i|): another
normalisation is a new option here, not an edit.

Shapes: B sequences (N prompts x G completions, the G of one prompt consecutive), C completion length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.errors import ConfigError


def group_advantages(rewards_B: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps) [B], groups of `group_size` consecutive rows.

    The std has Bessel's correction (the sample std); a group whose rewards are all equal gets
    advantage 0 everywhere: it carries no signal for a relative method."""
    if group_size < 2:
        raise ConfigError(f"rl.group_size: GRPO compares completions within a group; needs >= 2, got {group_size}")
    if rewards_B.dim() != 1 or rewards_B.numel() % group_size:
        raise ValueError(f"rewards {tuple(rewards_B.shape)}: expected [N * group_size] with group_size {group_size}")
    r_NG = rewards_B.double().reshape(-1, group_size)
    a_NG = (r_NG - r_NG.mean(-1, keepdim=True)) / (r_NG.std(-1, keepdim=True) + eps)
    return a_NG.reshape(-1).to(rewards_B.dtype if rewards_B.is_floating_point() else torch.float32)


def completion_mask(completion_BC: torch.Tensor, eos_id: int) -> torch.Tensor:
    """bool [B, C]: the completion tokens that are scored, up to and including the first EOS (what follows
    an EOS is padding the sampler filled in, not a choice of the policy)."""
    is_eos = (completion_BC == eos_id).long()
    return (is_eos.cumsum(-1) - is_eos) == 0


@dataclass(frozen=True)
class GRPOLoss:
    """The loss of one inner update and its statistics (detached, over completion tokens)."""

    loss: torch.Tensor
    """-J: the scalar to minimise."""
    clip_fraction: torch.Tensor
    """Share of completion tokens whose clipped term is the smaller one (the clip is active)."""
    kl_mean: torch.Tensor
    """Mean k3 estimate of KL(pi || pi_ref) per token."""
    ratio_mean: torch.Tensor
    """Mean of rho = pi / pi_old per token (1 at the first inner update)."""


def sequence_mean(values_BC: torch.Tensor, mask_BC: torch.Tensor) -> torch.Tensor:
    """Mean over each sequence's completion tokens, then over sequences (a sequence without tokens counts 0)."""
    m = mask_BC.to(values_BC.dtype)
    return ((values_BC * m).sum(-1) / m.sum(-1).clamp_min(1)).mean()


def k3_kl(logp_BC: torch.Tensor, ref_logp_BC: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref) from samples of pi: exp(d) - d - 1, d = ref - logp."""
    d = ref_logp_BC - logp_BC
    return torch.exp(d) - d - 1


def grpo_loss(
    logp_BC: torch.Tensor,
    old_logp_BC: torch.Tensor,
    ref_logp_BC: torch.Tensor | None,
    advantages_B: torch.Tensor,
    mask_BC: torch.Tensor,
    *,
    clip_eps: float,
    beta: float,
) -> GRPOLoss:
    """-J of the module docstring. `logp_BC`: the current policy's estimate (differentiable);
    `old_logp_BC`: the policy that sampled (detached; at the first of mu updates it equals `logp_BC`);
    `ref_logp_BC`: the reference policy (None when beta = 0); `mask_BC`: the completion tokens scored."""
    if beta > 0 and ref_logp_BC is None:
        raise ValueError("beta > 0 needs the reference policy's log-probs")
    mask = mask_BC.bool()
    ratio_BC = torch.exp(logp_BC - old_logp_BC.detach())
    a_B1 = advantages_B.to(logp_BC.dtype)[:, None]
    unclipped = ratio_BC * a_B1
    clipped = torch.clamp(ratio_BC, 1.0 - clip_eps, 1.0 + clip_eps) * a_B1
    per_token = torch.minimum(unclipped, clipped)
    kl_BC = k3_kl(logp_BC, ref_logp_BC.detach()) if ref_logp_BC is not None else torch.zeros_like(logp_BC)
    if beta > 0:
        per_token = per_token - beta * kl_BC
    loss = -sequence_mean(per_token, mask)
    with torch.no_grad():
        n = mask.sum().clamp_min(1)
        clip_fraction = ((clipped < unclipped) & mask).sum() / n
        kl_mean = (kl_BC * mask).sum() / n
        ratio_mean = (ratio_BC * mask).sum() / n
    return GRPOLoss(loss, clip_fraction, kl_mean, ratio_mean)
