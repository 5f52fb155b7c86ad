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

from dllm.config.base import Float, Int, RelPath, Section, Seed
from dllm.config.registries import REWARDS
from dllm.config.sampler import SamplerConfig

USER_REWARD = r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*"
"""`package.module:function`: a user reward, imported by exactly that name."""

_PARAMS = {"pattern": "format", "match": "format", "target_tokens": "length_penalty", "per_token": "length_penalty"}


class RewardConfig(Section):
    """One reward term: a registered reward or a user function, its weight and its own parameters."""

    name: Literal[REWARDS.names()] | Annotated[str, StringConstraints(pattern=USER_REWARD)]  # type: ignore[valid-type]
    """A registered reward (exact_answer, format, length_penalty) or a user function as `module:function`."""
    weight: Float = 1.0
    """Factor of this term in the summed reward."""
    pattern: str | None = None
    """format: the regular expression (Python `re` syntax) the completion must match."""
    match: Literal["fullmatch", "search"] = "fullmatch"
    """format: fullmatch (the whole completion, stripped of surrounding whitespace) or search (anywhere in it)."""
    target_tokens: Int | None = Field(default=None, ge=0)
    """length_penalty: completion tokens allowed without penalty."""
    per_token: Float = Field(default=0.01, ge=0)
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
            # a value other than the default, not "set": the resolved config (config.yaml) spells out every field
            if getattr(self, param) != type(self).model_fields[param].default and self.name != owner:
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


class PromptsConfig(Section):
    """Where the prompts of the rollouts come from: a built-in generated task, a JSONL file of
    {"prompt": ..., "answer": ...} records, or a prompts artifact written by `dllm data prepare`."""

    task: str | None = None
    """A built-in generated task with exact answers (addition, addition3, copy, pattern, countdown, sudoku4)."""
    path: RelPath | None = None
    """A JSONL file of {"prompt": "...", "answer": "..."} records, or a prompts artifact folder (instead of task)."""
    num_prompts: Int = Field(default=512, gt=0)
    """Prompts generated from the task (or read from the file, at most); each round draws from them."""
    seed: Seed = 0
    """Seed of the generated task's examples (use another seed than the held-out evaluation's)."""

    @model_validator(mode="after")
    def _one_source(self) -> PromptsConfig:
        if (self.task is None) == (self.path is None):
            raise ValueError(
                "give exactly one of task (a built-in task name) or path (prompt/answer JSONL or prepared artifact)"
            )
        return self


def _rollout_sampler() -> SamplerConfig:
    return SamplerConfig(temperature=1.0)


class RLConfig(Section):
    """diffu-GRPO (d1, Zhao et al. 2025): G scored completions per prompt, mu clipped updates per round."""

    rewards: list[RewardConfig] = Field(min_length=1)
    """The reward terms, summed with their weights into one scalar per completion."""
    group_size: Int = Field(default=8, ge=2)
    """G: completions sampled per prompt; advantages are normalised within each group (GRPO needs >= 2)."""
    p_mask_prompt: Float = Field(default=0.15, ge=0, lt=1)
    """Probability of masking each prompt token in the log-prob estimate, drawn afresh per inner update (d1: 0.15)."""
    clip_eps: Float = Field(default=0.2, gt=0, lt=1)
    """Clip range of the ratio pi/pi_old: [1 - clip_eps, 1 + clip_eps] (PPO)."""
    beta: Float = Field(default=0.04, ge=0)
    """Weight of the KL penalty to the reference policy (k3 estimator; DeepSeekMath: 0.04); 0 needs no reference."""
    inner_updates: Int = Field(default=12, ge=1)
    """mu: gradient updates per generation round on the same completions (d1: 12)."""
    prompts: PromptsConfig | None = None
    """The prompts and reference answers the policy is rewarded on (required)."""
    sampler: SamplerConfig = Field(default_factory=_rollout_sampler)
    """How rollouts are decoded (any sampler the decode profile allows; temperature > 0 gives a group variety)."""
