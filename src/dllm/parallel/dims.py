"""The process environment and the named DeviceMesh that parallelism is applied over."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from dllm.config.training import TopologyConfig


@dataclass(frozen=True)
class DistEnv:
    """Rank facts of this process, read from the torchrun environment (one process without it)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls) -> DistEnv:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )


def pick_device(requested: str, env: DistEnv) -> torch.device:
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_process_group(env: DistEnv, cfg: TopologyConfig, device: torch.device) -> None:
    """Join the torchrun rendezvous (env://); a no-op for a single process."""
    if not env.distributed or dist.is_initialized():
        return
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension; their product is the world size."""

    dp: int
    world_size: int

    @classmethod
    def from_topology(cls, cfg: TopologyConfig, world_size: int) -> ParallelDims:
        dp = world_size if cfg.dp_size == -1 else cfg.dp_size
        assert dp == world_size, "checked by config rules"
        return cls(dp=dp, world_size=world_size)

    def build_mesh(self, device: torch.device) -> DeviceMesh | None:
        if self.world_size == 1:
            return None
        return init_device_mesh(device.type, (self.dp,), mesh_dim_names=("dp",))


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks (identity for one process)."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
