"""rl/logprob.py: diffu-GRPO's one-forward log-prob estimate against a hand computation on a tiny model.

Shapes: B batch, P prompt length, C completion length, L = P + C, V vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models.transformer import Transformer
from dllm.rl.logprob import diffu_grpo_logprobs, mask_prompt

V = 32
MASK = 31
PAD = 30


def tiny(seed: int = 0) -> Transformer:
    model = Transformer(ModelConfig(preset="tiny", vocab_size=V, init_std=0.1, num_layers=1))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Transformer:
    return tiny()


def hand_logprobs(model, prompt_BP, completion_BC, noisy_BP, valid_BP, shift: bool) -> torch.Tensor:
    """Written out position by position: the masked row, the model call, log_softmax, the gathered target."""
    B, P = prompt_BP.shape
    C = completion_BC.shape[1]
    out = torch.zeros(B, C)
    for b in range(B):
        keep = valid_BP[b]
        row = torch.cat([noisy_BP[b][keep], torch.full((C,), MASK)])  # the row without its padding
        n = int(keep.sum())
        logits = model(row[None], torch.arange(n + C)[None], AttentionMask("bidirectional")).logits()[0].float()
        logits[:, MASK] = float("-inf")
        for j in range(C):
            src = n + j - 1 if shift else n + j
            out[b, j] = logits[src].log_softmax(-1)[completion_BC[b, j]]
    return out


PROMPT = torch.tensor([[PAD, PAD, 3, 4, 5], [6, 7, 8, 9, 10]])
VALID = PROMPT != PAD
COMPLETION = torch.tensor([[11, 12, 13], [14, 15, 16]])


@pytest.mark.parametrize("shift", [False, True])
def test_estimator_equals_hand_computation(model, shift):
    gen = torch.Generator().manual_seed(3)
    logp = diffu_grpo_logprobs(model, PROMPT, COMPLETION, MASK, 0.4, gen, prompt_valid_BP=VALID, shift=shift)
    noisy = mask_prompt(PROMPT, MASK, 0.4, torch.Generator().manual_seed(3), VALID)  # the same draw
    assert (noisy == MASK).any() and (noisy != PROMPT).sum() < VALID.sum()  # some, not all, prompt tokens masked
    assert ((noisy == MASK) <= VALID).all()  # padding is never masked
    expected = hand_logprobs(model, PROMPT, COMPLETION, noisy, VALID, shift)
    assert logp.shape == (2, 3) and logp.dtype == torch.float32
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)
    assert (logp < 0).all()


def test_prompt_mask_follows_the_generator_and_p_zero_keeps_the_prompt(model):
    prompt = torch.randint(0, 29, (4, 16), generator=torch.Generator().manual_seed(0))
    draws = [mask_prompt(prompt, MASK, 0.5, torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    frac = (draws[0] == MASK).float().mean().item()
    assert 0.3 < frac < 0.7
    assert torch.equal(mask_prompt(prompt, MASK, 0.0, torch.Generator().manual_seed(1)), prompt)
    completion = torch.randint(0, 29, (4, 3), generator=torch.Generator().manual_seed(1))
    a = diffu_grpo_logprobs(model, prompt, completion, MASK, 0.0, torch.Generator().manual_seed(1))
    b = diffu_grpo_logprobs(model, prompt, completion, MASK, 0.0, torch.Generator().manual_seed(2))
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # p = 0: no randomness at all
    c = diffu_grpo_logprobs(model, prompt, completion, MASK, 0.5, torch.Generator().manual_seed(2))
    assert not torch.allclose(a, c)  # a masked prompt changes the estimate


def test_estimator_is_differentiable_and_rejects_bad_p(model):
    logp = diffu_grpo_logprobs(model, PROMPT, COMPLETION, MASK, 0.2, torch.Generator().manual_seed(0),
                               prompt_valid_BP=VALID)  # fmt: skip
    logp.sum().backward()
    assert model.embed_tokens.weight.grad is not None and model.embed_tokens.weight.grad.abs().sum() > 0
    model.zero_grad()
    with pytest.raises(ValueError, match="p_mask_prompt"):
        mask_prompt(PROMPT, MASK, 1.0, None)
