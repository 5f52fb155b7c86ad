"""Training objectives behind one registry, selected by `objective.name`."""

from __future__ import annotations

from dllm.diffusion.objectives.base import LossOutput, ModelInputs, ModelOutput, Objective
from dllm.diffusion.objectives.mdlm import MDLMObjective
from dllm.registry import Registry

OBJECTIVES: Registry[type] = Registry("objective")
OBJECTIVES.add("mdlm", MDLMObjective)

__all__ = ["OBJECTIVES", "LossOutput", "MDLMObjective", "ModelInputs", "ModelOutput", "Objective"]
