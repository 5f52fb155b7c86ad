"""Parallelism applied from outside the model: process groups, meshes, FSDP2/DDP, the launcher."""
