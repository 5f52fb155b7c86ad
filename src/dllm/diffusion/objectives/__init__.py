"""Training objectives, registered by name in dllm.config.registries.OBJECTIVES (`objective.name`)."""

from __future__ import annotations

from dllm.diffusion.objectives.base import LossOutput, ModelInputs, Objective, TokenIds
from dllm.diffusion.objectives.block import BD3LMObjective, FastDLLMv2Objective
from dllm.diffusion.objectives.mdlm import MDLMObjective
from dllm.diffusion.objectives.uniform import UniformObjective

__all__ = [
    "BD3LMObjective", "FastDLLMv2Objective", "LossOutput", "MDLMObjective", "ModelInputs",
    "Objective", "TokenIds", "UniformObjective",
]  # fmt: skip
