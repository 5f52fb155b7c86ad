"""RunSpec: the typed description of one training run, section by section.

Every section receives only what it needs downstream: `training/build.py` is the only code that
sees a whole RunSpec. Cross-section rules that need no I/O (batch divisibility, world size) live in
`rules.py`; those that read the tokenizer, the artifact or the devices in `dllm.training.preflight`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from dllm.config.base import OutputFolder, Section
from dllm.config.data import DataConfig, TokenizerConfig
from dllm.config.model import LoraConfig, ModelConfig
from dllm.config.objectives import MDLMConfig, ObjectiveConfig
from dllm.config.observability import ProfilingConfig
from dllm.config.rl import RLConfig
from dllm.config.training import (
    CheckpointingConfig,
    LoggingConfig,
    OptimizerConfig,
    SchedulerConfig,
    TopologyConfig,
    TrainingConfig,
)

LATEST_RUN_LINK = "latest"
"""The link in run.output_dir to the newest run folder: no run may take its name."""


class RunConfig(Section):
    """Where the run writes its checkpoints, metrics and resolved config."""

    name: str = Field(default="run", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    """Run name: the run folder is output_dir/name."""
    output_dir: OutputFolder = Field(default=Path("runs"), validate_default=True)
    """Folder that holds run folders and the `latest` link."""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        """output_dir/latest is the link to the newest run: a run of that name would make it point to itself
        (the comparison ignores case, as a case-insensitive filesystem does)."""
        if name.lower() == LATEST_RUN_LINK:
            raise ValueError(f"reserved: output_dir/{LATEST_RUN_LINK} links to the newest run; choose another name")
        return name


class RunSpec(Section):
    """Everything one training run needs."""

    @model_validator(mode="before")
    @classmethod
    def _default_objective_name(cls, data: Any) -> Any:
        """An objective section without `name` is MDLM (the spine's objective)."""
        if isinstance(data, dict) and isinstance(data.get("objective"), dict) and "name" not in data["objective"]:
            data = {**data, "objective": {"name": "mdlm", **data["objective"]}}
        return data

    run: RunConfig = RunConfig()
    """Run folder."""
    model: ModelConfig = ModelConfig()
    """Network architecture."""
    tokenizer: TokenizerConfig = TokenizerConfig()
    """Tokenizer (must match the one that prepared the data)."""
    data: DataConfig | None = None
    """Prepared training data (required, except for an rl run, which generates its own batches)."""
    objective: ObjectiveConfig = Field(default_factory=MDLMConfig)
    """Training objective: mdlm, bd3lm, fast_dllm_v2, uniform, ar or dflash_distillation (`name`)."""
    training: TrainingConfig
    """Training loop."""
    optimizer: OptimizerConfig = OptimizerConfig()
    """Optimizer."""
    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    """Checkpoints and resume."""
    logging: LoggingConfig = LoggingConfig()
    """Metrics and progress."""
    topology: TopologyConfig = TopologyConfig()
    """Processes and parallelism."""
    lora: LoraConfig | None = None
    """LoRA adapters; null trains every parameter."""
    profiling: ProfilingConfig | None = None
    """A torch.profiler trace of a few steps in the run folder; null: no profiling."""
    rl: RLConfig | None = None
    """Reinforcement learning (diffu-GRPO) on generated completions instead of prepared data; null: off."""

    @model_validator(mode="after")
    def _data_or_rl(self) -> RunSpec:
        if self.data is None and self.rl is None:
            raise ValueError("data: required (the prepared training data: path and seq_len)")
        return self
