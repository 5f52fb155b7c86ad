"""Checkpoints: torch.distributed.checkpoint folders published atomically, with auto-resume."""

from dllm.checkpoint.manager import CheckpointManager, load_model_weights

__all__ = ["CheckpointManager", "load_model_weights"]
