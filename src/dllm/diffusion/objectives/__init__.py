"""Training objectives behind one registry, selected by `objective.name`."""

from __future__ import annotations

from dllm.diffusion.objectives.base import LossOutput, ModelInputs, Objective, TokenIds
from dllm.diffusion.objectives.block import BD3LMObjective, FastDLLMv2Objective
from dllm.diffusion.objectives.mdlm import MDLMObjective
from dllm.diffusion.objectives.uniform import UniformObjective
from dllm.registry import Registry

OBJECTIVES: Registry[type] = Registry("objective")
OBJECTIVES.add("mdlm", MDLMObjective)
OBJECTIVES.add("bd3lm", BD3LMObjective)
OBJECTIVES.add("fast_dllm_v2", FastDLLMv2Objective)
OBJECTIVES.add("uniform", UniformObjective)

__all__ = [
    "OBJECTIVES", "BD3LMObjective", "FastDLLMv2Objective", "LossOutput", "MDLMObjective", "ModelInputs",
    "Objective", "TokenIds", "UniformObjective",
]  # fmt: skip
