"""The reinforcement-learning section (diffu-GRPO): rewards, group size, prompt masking, clip and KL.

Its own section rather than an entry of config/objectives.py: an objective turns a prepared batch into
a loss (`prepare`/`loss`), while RL generates its own batches (G completions per prompt through the
sampler), scores them and runs mu updates per generation round. The trainer integration reads this
section beside the objective of the reference model; nothing here names a class except through the
REWARDS registry (a user reward is named `module:function` and imported only by that name, in rl/).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, ValidationError, field_validator, model_validator

from dllm.config.base import Section
from dllm.config.registries import REWARDS

USER_REWARD = r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*"
"""`package.module:function`: a user reward, imported by exactly that name."""

_PARAMS = {"pattern": "format", "match": "format", "target_tokens": "length_penalty", "per_token": "length_penalty"}


class RewardConfig(Section):
    """One reward term: a registered reward or a user function, its weight and its own parameters."""

    name: Literal[REWARDS.names()] | Annotated[str, StringConstraints(pattern=USER_REWARD)]  # type: ignore[valid-type]
    """A registered reward (exact_answer, format, length_penalty) or a user function as `module:function`."""
    weight: float = 1.0
    """Factor of this term in the summed reward."""
    pattern: str | None = None
    """format: the regular expression (Python `re` syntax) the completion must match."""
    match: Literal["fullmatch", "search"] = "fullmatch"
    """format: fullmatch (the whole completion, stripped of surrounding whitespace) or search (anywhere in it)."""
    target_tokens: int | None = Field(default=None, ge=0)
    """length_penalty: completion tokens allowed without penalty."""
    per_token: float = Field(default=0.01, ge=0)
    """length_penalty: reward lost per completion token beyond target_tokens (linear)."""

    @field_validator("name", mode="wrap")
    @classmethod
    def _known_name(cls, value, handler):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"unknown reward {value!r}: use one of {', '.join(REWARDS.names())}, "
                             "or a user function as module:function") from None  # fmt: skip

    @model_validator(mode="after")
    def _params_fit_the_reward(self) -> RewardConfig:
        for param, owner in _PARAMS.items():
            if param in self.model_fields_set and self.name != owner:
                raise ValueError(f"{param} applies to reward {owner} only, not {self.name}")
        if self.name == "format":
            if self.pattern is None:
                raise ValueError("reward format needs a pattern (a regular expression)")
            try:
                re.compile(self.pattern)
            except re.error as e:
                raise ValueError(f"pattern {self.pattern!r} is not a regular expression: {e}") from None
        if self.name == "length_penalty" and self.target_tokens is None:
            raise ValueError("reward length_penalty needs target_tokens")
        return self


class RLConfig(Section):
    """diffu-GRPO (d1, Zhao et al. 2025): G scored completions per prompt, mu clipped updates per round."""

    rewards: list[RewardConfig] = Field(min_length=1)
    """The reward terms, summed with their weights into one scalar per completion."""
    group_size: int = Field(default=8, ge=2)
    """G: completions sampled per prompt; advantages are normalised within each group (GRPO needs >= 2)."""
    p_mask_prompt: float = Field(default=0.15, ge=0, lt=1)
    """Probability of masking each prompt token in the log-prob estimate, drawn afresh per inner update (d1: 0.15)."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """Clip range of the ratio pi/pi_old: [1 - clip_eps, 1 + clip_eps] (PPO)."""
    beta: float = Field(default=0.04, ge=0)
    """Weight of the KL penalty to the reference policy (k3 estimator; DeepSeekMath: 0.04); 0 needs no reference."""
    inner_updates: int = Field(default=12, ge=1)
    """mu: gradient updates per generation round on the same completions (d1: 12)."""
