"""Rewards: functions of one scored completion (`Sample`) to a number, summed with their weights.

Registered rewards (config/registries.py REWARDS, configured by config/rl.py RewardConfig):
- `exact_answer`: 1 when the task's verifier accepts the answer (the completion cut at the task's stop
  strings: evaluation/tasks.py `extract_answer`, `Example.correct`), else 0;
- `format`: 1 when the completion matches a regular expression (fullmatch of the stripped completion,
  or search anywhere in it), else 0;
- `length_penalty`: -per_token * (tokens beyond target_tokens), 0 up to the target (linear).
A user reward is named `module:function` in the config and imported by exactly that name (the module
with importlib, the function with getattr): the config never imports anything else on a user's behalf.
It is called as `function(sample)` and returns a number (bool counts as 0/1).

Shapes: B completions.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dllm.config.registries import REWARDS
from dllm.config.rl import RewardConfig
from dllm.errors import ConfigError
from dllm.evaluation.tasks import Example, Task, extract_answer


@dataclass(frozen=True)
class Sample:
    """One completion to score, with the example it answers."""

    prompt: str
    completion: str
    """The generated text, decoded, as sampled (not cut at the stop strings)."""
    num_tokens: int
    """Completion tokens that count (up to and including the first EOS)."""
    example: Example
    """The task example: its reference answer and, for puzzles, its verifier."""
    task: Task
    """The task the example belongs to (its stop strings cut the answer out of the completion)."""


RewardFn = Callable[[Sample], float]


class ExactAnswer:
    """1.0 when the task's verifier accepts the extracted answer, else 0.0."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg

    def __call__(self, sample: Sample) -> float:
        return float(sample.example.correct(extract_answer(sample.task, sample.completion)))


class FormatMatch:
    """1.0 when the completion matches the configured regular expression, else 0.0."""

    def __init__(self, cfg: RewardConfig) -> None:
        assert cfg.pattern is not None  # RewardConfig requires it for format
        self.regex = re.compile(cfg.pattern)
        self.full = cfg.match == "fullmatch"

    def __call__(self, sample: Sample) -> float:
        if self.full:
            return float(self.regex.fullmatch(sample.completion.strip()) is not None)
        return float(self.regex.search(sample.completion) is not None)


class LengthPenalty:
    """-per_token for every completion token beyond target_tokens."""

    def __init__(self, cfg: RewardConfig) -> None:
        assert cfg.target_tokens is not None  # RewardConfig requires it for length_penalty
        self.target, self.per_token = cfg.target_tokens, cfg.per_token

    def __call__(self, sample: Sample) -> float:
        return -self.per_token * max(0, sample.num_tokens - self.target)


def import_user_reward(name: str, where: str) -> RewardFn:
    """The function `module:function`, imported by that explicit name; a ConfigError naming `where`
    (the config field) when it cannot be imported or is not callable."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:  # ModuleNotFoundError included; other errors are the user module's own bugs
        raise ConfigError(f"{where}: cannot import module {module_name!r} of reward {name!r} ({e}); "
                          "install it or put its folder on PYTHONPATH") from None  # fmt: skip
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{where}: module {module_name!r} has no {attr!r} (reward {name!r})")
    if not callable(fn):
        raise ConfigError(f"{where}: reward {name!r} is a {type(fn).__name__}, not a function")
    return fn


@dataclass(frozen=True)
class RewardTerm:
    name: str
    weight: float
    fn: RewardFn


class Rewards:
    """The configured reward terms; `score` sums them with their weights."""

    def __init__(self, configs: Sequence[RewardConfig], where: str = "rl.rewards") -> None:
        self.terms = [RewardTerm(c.name, c.weight, build_reward(c, f"{where}.{i}.name")) for i, c in enumerate(configs)]

    def score(self, samples: Sequence[Sample]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(total reward [B] float32, each term's unweighted values [B] by name, for metrics)."""
        parts: dict[str, torch.Tensor] = {}
        total = torch.zeros(len(samples), dtype=torch.float32)
        for term in self.terms:
            values = torch.tensor([_number(term, term.fn(s)) for s in samples], dtype=torch.float32)
            parts[term.name] = values
            total += term.weight * values
        return total, parts


def build_reward(cfg: RewardConfig, where: str) -> RewardFn:
    """A registered reward built from its section, or the user function the name points to."""
    if cfg.name in REWARDS:
        return REWARDS.resolve(cfg.name)(cfg)
    return import_user_reward(cfg.name, where)


def _number(term: RewardTerm, value: object) -> float:
    if isinstance(value, numbers.Real) and math.isfinite(float(value)):
        return float(value)
    raise ConfigError(f"reward {term.name!r} returned {value!r}; a reward must return a finite number")
