"""Reinforcement learning with verifiable rewards for diffusion policies (diffu-GRPO; d1, Zhao et al. 2025):
log-prob estimators (logprob.py), group-normalised advantages and the clipped GRPO loss (grpo.py), and
rewards (rewards.py) over the exact-answer tasks of evaluation/tasks.py."""
