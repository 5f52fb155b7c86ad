"""Per-token log-probabilities of a completion under a masked diffusion policy.

A masked diffusion model has no tractable sequence likelihood, so policy-gradient methods estimate
one. diffu-GRPO (d1, Zhao et al. 2025, section 3.2) uses one forward pass per estimate: the completion
is fully masked and every real prompt token is masked independently with probability `p_mask_prompt`;
the log-probability of completion token j is then read from the model's prediction at its (masked)
position, all tokens at once (a mean-field estimate). Drawing a fresh prompt mask for each inner update
acts as a regulariser (d1 calls it random prompt masking). Other estimators (a multi-sample ELBO, for
instance) belong beside this one, each its own function with the same output: `logp_BC`.

The mask token is never a prediction (its logit is -inf), as in the training loss (models/chunked_ce.py)
and the sampler. Prompts are left-padded (sampling/canvas.py `left_pad`); padding keys are hidden from
attention and positions count from each prompt's first real token, as the sampling canvas does.

Shapes: B batch, P prompt length, C completion length, L = P + C, E hidden, V vocabulary.
"""

from __future__ import annotations

import torch

from dllm.attention.masks import AttentionMask


def mask_prompt(
    prompt_BP: torch.Tensor,
    mask_id: int,
    p_mask_prompt: float,
    generator: torch.Generator | None,
    prompt_valid_BP: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prompt with each real token replaced by `mask_id` with probability `p_mask_prompt` (padding
    stays). The draw is on the generator's device (CPU by default), so it is the same on every device."""
    if not 0.0 <= p_mask_prompt < 1.0:
        raise ValueError(f"p_mask_prompt must be in [0, 1), got {p_mask_prompt}")
    gen_device = generator.device if generator is not None else torch.device("cpu")
    u_BP = torch.rand(prompt_BP.shape, generator=generator, device=gen_device).to(prompt_BP.device)
    masked_BP = u_BP < p_mask_prompt
    if prompt_valid_BP is not None:
        masked_BP &= prompt_valid_BP.to(prompt_BP.device).bool()
    return torch.where(masked_BP, mask_id, prompt_BP)


def completion_logprobs(
    model: torch.nn.Module,
    noisy_prompt_BP: torch.Tensor,
    completion_BC: torch.Tensor,
    mask_id: int,
    *,
    prompt_valid_BP: torch.Tensor | None = None,
    shift: bool = False,
) -> torch.Tensor:
    """log p(completion_j | noisy prompt, all completion positions masked) [B, C], float32 at least, differentiable.

    One bidirectional forward over [noisy prompt ; C mask tokens]. `shift` (the decode profile's): row
    i-1 of the output predicts token i (Dream, Fast-dLLM v2), so completion token j is read from the row
    before it (the last prompt row for j = 0)."""
    B, P = noisy_prompt_BP.shape
    C = completion_BC.shape[1]
    device = noisy_prompt_BP.device
    if shift and P < 1:
        raise ValueError("a shifted model needs at least one prompt position to predict the first completion token")
    tokens_BL = torch.cat([noisy_prompt_BP, torch.full_like(completion_BC, mask_id)], dim=1)
    valid_BL = torch.ones(B, P + C, dtype=torch.bool, device=device)
    if prompt_valid_BP is not None:
        valid_BL[:, :P] = prompt_valid_BP.to(device).bool()
    positions_BL = (valid_BL.long().cumsum(-1) - 1).clamp_min(0)
    padded = not bool(valid_BL.all())
    mask = AttentionMask("bidirectional", key_valid_BL=valid_BL if padded else None)
    out = model(tokens_BL, positions_BL, mask)
    first = P - 1 if shift else P
    hidden_BCE = out.hidden_BLE[:, first : first + C]
    logits_BCV = out.token_logits(hidden_BCE, torch.tensor([mask_id], device=device))  # decoding's logits
    logp_BCV = logits_BCV.log_softmax(-1)
    return logp_BCV.gather(-1, completion_BC[..., None]).squeeze(-1)


def diffu_grpo_logprobs(
    model: torch.nn.Module,
    prompt_BP: torch.Tensor,
    completion_BC: torch.Tensor,
    mask_id: int,
    p_mask_prompt: float,
    generator: torch.Generator | None,
    *,
    prompt_valid_BP: torch.Tensor | None = None,
    shift: bool = False,
) -> torch.Tensor:
    """diffu-GRPO's estimate of log pi(completion token j | prompt) [B, C] (d1, Zhao et al. 2025): the
    prompt masked at random with probability `p_mask_prompt` (drawn from `generator`: pass a fresh draw
    per inner update, and the same generator state to reproduce one), the completion fully masked."""
    noisy_BP = mask_prompt(prompt_BP, mask_id, p_mask_prompt, generator, prompt_valid_BP)
    return completion_logprobs(model, noisy_BP, completion_BC, mask_id, prompt_valid_BP=prompt_valid_BP, shift=shift)
