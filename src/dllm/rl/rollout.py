"""Rollouts: G completions per prompt through THE sampling loop, scored by the rewards.

The G completions of one prompt are consecutive rows (rl/grpo.py `group_advantages`). Prompts are
left-padded as the sampling canvas pads them, so the log-prob estimator (rl/logprob.py) sees each
completion at the positions it was generated at.

Shapes: B = N prompts x G completions, P prompt length, C completion length (the sampler's gen_length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dllm.config.sampler import SamplerConfig
from dllm.evaluation.tasks import Example, Task, extract_answer
from dllm.inference.engine import generate
from dllm.rl.grpo import completion_mask
from dllm.rl.rewards import Rewards, Sample
from dllm.sampling.canvas import SpecialIds, left_pad
from dllm.sampling.results import Counters
from dllm.tokenization import Tokenizer


@dataclass
class Rollouts:
    """One generation round: the sampled completions, what the policy is trained on, and their scores."""

    prompt_BP: torch.Tensor
    prompt_valid_BP: torch.Tensor
    completion_BC: torch.Tensor
    mask_BC: torch.Tensor
    """The completion tokens scored: up to and including the first EOS."""
    rewards_B: torch.Tensor
    parts: dict[str, torch.Tensor]
    """Each reward term's unweighted values [B], by name."""
    correct_B: torch.Tensor
    """Whether the task's verifier accepts the answer (the accuracy metric, whatever the rewards are)."""
    counters: Counters


def rollout(
    model: torch.nn.Module,
    examples: list[Example],
    task: Task,
    tok: Tokenizer,
    cfg: SamplerConfig,
    special: SpecialIds,
    group_size: int,
    rewards: Rewards,
    generator: torch.Generator,
) -> Rollouts:
    """Sample `group_size` completions of every example's prompt in one batched `generate` call (`cfg`
    resolved against the decode profile), and score them."""
    device = next(model.parameters()).device
    prompt_ids = [tok.encode(e.prompt) for e in examples for _ in range(group_size)]
    was_training = model.training
    model.eval()
    try:
        result = generate(model, prompt_ids, cfg, special, generator=generator)
    finally:
        model.train(was_training)
    C = cfg.gen_length
    completion_BC = torch.stack([result.canvas_BL[b, s : s + C] for b, s in enumerate(result.gen_start_B)])
    mask_BC = completion_mask(completion_BC, special.eos_id)
    prompt_BP, valid_BP = left_pad(prompt_ids, special.pad_id, device)
    samples, correct = [], []
    for b, seq in enumerate(result.sequences):
        example = examples[b // group_size]
        text = tok.decode(seq)
        samples.append(Sample(example.prompt, text, int(mask_BC[b].sum()), example, task))
        correct.append(example.correct(extract_answer(task, text)))
    rewards_B, parts = rewards.score(samples)
    return Rollouts(prompt_BP, valid_BP, completion_BC.to(device), mask_BC.to(device), rewards_B, parts,
                    torch.tensor(correct, dtype=torch.bool), result.counters)  # fmt: skip
