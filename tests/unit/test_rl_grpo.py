"""rl/grpo.py: group-normalised advantages and the GRPO loss, its gradient checked through the real
log-prob estimator on a tiny model (with a fixed prompt mask: the same generator seed).

Shapes: B sequences (N prompts x G completions), P prompt length, C completion length.
"""

from __future__ import annotations

import math

import pytest
import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.transformer import Transformer
from dllm.rl.grpo import completion_mask, group_advantages, grpo_loss, k3_kl, sequence_mean
from dllm.rl.logprob import diffu_grpo_logprobs

V, MASK = 32, 31


def tiny(seed: int) -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, init_std=0.1, num_layers=1))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, 4, eps=0.0)
    s = math.sqrt(1 / 3)  # sample std of (1, 0, 0, 1): mean 0.5, squares sum 1, / (4 - 1)
    torch.testing.assert_close(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / s)
    assert torch.equal(group_advantages(r, 4)[4:], torch.zeros(4))  # no spread: no signal
    a2 = group_advantages(r, 2)  # groups of 2 consecutive rows
    assert a2[0] > 0 > a2[1] and a2[2] < 0 < a2[3] and torch.equal(a2[4:], torch.zeros(4))
    with pytest.raises(ConfigError, match=r"rl\.group_size.*>= 2, got 1"):
        group_advantages(r, 1)
    with pytest.raises(ValueError, match="group_size 3"):
        group_advantages(r, 3)


def test_loss_and_stats_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.1], [0.2, 0.4, 0.4]]))
    old = torch.log(torch.tensor([[0.25, 0.5, 0.1], [0.4, 0.4, 0.4]]))  # ratios 2, 1, 1 | 0.5, 1, 1
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([1.0, -1.0])
    out = grpo_loss(logp, old, None, adv, mask, clip_eps=0.2, beta=0.0)
    # row 0: min(2, 1.2) = 1.2 and 1 over 2 tokens; row 1: min(-0.5, -0.8) = -0.8, -1, -1 over 3
    expected = -((1.2 + 1.0) / 2 + (-0.8 - 1.0 - 1.0) / 3) / 2
    torch.testing.assert_close(out.loss, torch.tensor(expected))
    assert out.clip_fraction.item() == pytest.approx(2 / 5)  # the ratio-2 and ratio-0.5 tokens
    assert out.ratio_mean.item() == pytest.approx((2 + 1 + 0.5 + 1 + 1) / 5)
    assert out.kl_mean.item() == 0.0
    ref = old
    with_kl = grpo_loss(logp, old, ref, adv, mask, clip_eps=0.2, beta=0.1)
    kl = k3_kl(logp, ref)
    assert (kl >= 0).all() and kl[0, 1] == 0
    torch.testing.assert_close(with_kl.loss, torch.tensor(expected) + 0.1 * sequence_mean(kl, mask))
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, old, None, adv, mask, clip_eps=0.2, beta=0.1)


def test_completion_mask_stops_after_the_first_eos():
    eos = 29
    c = torch.tensor([[5, 6, 29, 29, 7], [5, 6, 7, 8, 9], [29, 1, 2, 29, 3]])
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert completion_mask(c, eos).long().tolist() == expected


PROMPT = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [5, 6, 7, 8]])
COMPLETION = torch.tensor([[9, 10, 11], [12, 29, 14], [15, 16, 17], [29, 19, 20]])  # 29: EOS
COMPLETION_MASK = completion_mask(COMPLETION, 29)  # rows 1 and 3 end early


def logp_of(model) -> torch.Tensor:
    """The estimator with a fixed prompt mask (the same seed each call)."""
    return diffu_grpo_logprobs(model, PROMPT, COMPLETION, MASK, 0.3, torch.Generator().manual_seed(7))


def grads(model, loss) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def assert_same_grads(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) > 0 and any(g.abs().sum() > 0 for g in a)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


def test_zero_advantages_change_the_policy_only_through_kl():
    policy, ref = tiny(0), tiny(1)
    with torch.no_grad():
        ref_logp = logp_of(ref)
        old = logp_of(policy) + torch.randn(4, 3, generator=torch.Generator().manual_seed(0)) * 0.5  # ratios != 1
    zeros = torch.zeros(4)
    out = grpo_loss(logp_of(policy), old, ref_logp, zeros, COMPLETION_MASK, clip_eps=0.2, beta=0.04)
    assert out.clip_fraction.item() == 0.0 and out.kl_mean.item() > 0  # A = 0: no clipping counted
    got = grads(policy, out.loss)
    kl_only = 0.04 * sequence_mean(k3_kl(logp_of(policy), ref_logp), COMPLETION_MASK)
    assert_same_grads(got, grads(policy, kl_only))
    no_kl = grpo_loss(logp_of(policy), old, ref_logp, zeros, COMPLETION_MASK, clip_eps=0.2, beta=0.0)
    assert no_kl.loss.item() == 0.0 and all(g.abs().sum() == 0 for g in grads(policy, no_kl.loss))


def test_beta_zero_one_inner_update_is_reinforce():
    """mu = 1: the sampling policy is the current one (logp_old = logp.detach(), ratio 1, no clip), and the
    gradient is -1/B sum_i A_i 1/|o_i| sum_t grad logp_it: REINFORCE with group-normalised advantages."""
    policy = tiny(0)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    logp = logp_of(policy)
    out = grpo_loss(logp, logp.detach(), None, adv, COMPLETION_MASK, clip_eps=0.01, beta=0.0)
    assert COMPLETION_MASK.long().tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 0, 0]]
    assert out.ratio_mean.item() == pytest.approx(1.0) and out.clip_fraction.item() == 0.0
    got = grads(policy, out.loss)
    reinforce = -sequence_mean(adv[:, None] * logp_of(policy), COMPLETION_MASK)
    assert_same_grads(got, grads(policy, reinforce))


def test_inner_updates_move_probability_towards_the_better_completion():
    """mu clipped updates on one group, each with its own prompt mask: pi_old of update k is the sampling
    policy under update k's mask (computed before the updates), so the ratio compares like with like."""
    policy = tiny(0)
    prompt, completions = PROMPT[:2], torch.tensor([[9, 10, 11], [12, 13, 14]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2)
    seeds = [11, 12, 13, 14]  # one prompt mask per inner update

    def logp(seed: int, p_mask: float = 0.3) -> torch.Tensor:
        return diffu_grpo_logprobs(policy, prompt, completions, MASK, p_mask, torch.Generator().manual_seed(seed))

    with torch.no_grad():
        old = [logp(s) for s in seeds]
        ref = [logp(s) for s in seeds]  # the reference: the policy as it was at the start
        before = logp(0, p_mask=0.0).sum(-1)
    opt = torch.optim.SGD(policy.parameters(), lr=0.05)
    for k, seed in enumerate(seeds):
        out = grpo_loss(logp(seed), old[k], ref[k], adv, mask, clip_eps=0.2, beta=0.01)
        if k == 0:
            assert out.ratio_mean.item() == pytest.approx(1.0) and out.kl_mean.item() == pytest.approx(0.0)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    with torch.no_grad():
        after = logp(0, p_mask=0.0).sum(-1)
    assert after[0] - before[0] > 0 > after[1] - before[1]
