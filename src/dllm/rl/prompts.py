"""The prompts of an rl run (config/rl.py PromptsConfig) as an exact-answer Task (evaluation/tasks.py)."""

from __future__ import annotations

from dllm.config.rl import PromptsConfig
from dllm.errors import ConfigError, DataError
from dllm.evaluation.tasks import BUILTIN, load_task
from dllm.evaluation.tasks import Task as Task


def load_prompts(cfg: PromptsConfig) -> Task:
    """The built-in task's `num_prompts` generated examples, or the JSONL file's first `num_prompts` records;
    a ConfigError naming the field for an unknown task or a file whose records lack a prompt or an answer."""
    if cfg.task is not None:
        if cfg.task not in BUILTIN:
            raise ConfigError(f"rl.prompts.task: unknown task {cfg.task!r}; use one of {', '.join(BUILTIN)}")
        return load_task(cfg.task, cfg.num_prompts, cfg.seed)
    assert cfg.path is not None  # PromptsConfig holds exactly one source
    if not cfg.path.is_file():
        raise ConfigError(f"rl.prompts.path: {cfg.path} is not a file (a JSONL of prompt/answer records)")
    try:
        return load_task(str(cfg.path), cfg.num_prompts)
    except DataError as e:
        raise ConfigError(f"rl.prompts.path: {e}") from None
