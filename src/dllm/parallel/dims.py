"""The process environment and the named DeviceMesh that parallelism is applied over."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

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
    """Sizes of each parallel dimension: world = dp x group, where a context group of `group` ranks
    shares each sequence (`topology.context`; group 1 without context/block parallelism).

    World rank w is data-parallel index w // group and rank w % group inside its context group, so a
    group is `group` consecutive ranks (one node, when group divides nproc_per_node). Gradients are
    reduced over all dp x group ranks (one FSDP/DDP mesh dimension over the world); the CP process
    groups (cp, csbp) are separate communicators: a CP axis never shares one with data parallelism.
    """

    dp: int
    world_size: int
    mode: Literal["none", "cp", "bp", "csbp"] = "none"
    cp: int = 1
    bp: int = 1

    @classmethod
    def from_topology(cls, cfg: TopologyConfig, world_size: int) -> ParallelDims:
        ctx = cfg.context
        group = ctx.group_size
        dp = world_size // group if cfg.dp_size == -1 else cfg.dp_size
        assert dp * group == world_size, "checked by config rules"
        if group == 1:  # cp_size 1 or bp_size 1: nothing to split (preflight warns)
            return cls(dp=dp, world_size=world_size)
        return cls(dp=dp, world_size=world_size, mode=ctx.mode, cp=ctx.cp_size, bp=ctx.bp_size)

    @property
    def group(self) -> int:
        """Ranks that share one sequence: cp (cp), bp (bp, csbp), 1 (none)."""
        return {"none": 1, "cp": self.cp}.get(self.mode, self.bp)

    def dp_index(self, rank: int) -> int:
        """The data-parallel index of a world rank: which share of the global batch it reads."""
        return rank // self.group

    def group_rank(self, rank: int) -> int:
        """A world rank's index inside its context group (the rank of its ShardPlan)."""
        return rank % self.group

    def cp_groups(self) -> list[list[int]]:
        """World ranks of every CP process group (cp, csbp): per data-parallel index, its context group
        cut into runs of cp consecutive ranks (parallel.context.cp_group_ranks), in one fixed order."""
        if self.mode not in ("cp", "csbp"):
            return []
        return [
            [d * self.group + base + i for i in range(self.cp)]
            for d in range(self.dp)
            for base in range(0, self.group, self.cp)
        ]

    def build_mesh(self, device: torch.device) -> DeviceMesh | None:
        """The data-parallel mesh of FSDP/DDP: one dimension over every rank (dp x group)."""
        if self.world_size == 1:
            return None
        return init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("dp",))

    def build_cp_group(self, rank: int) -> dist.ProcessGroup | None:
        """This rank's CP process group, None when nothing is gathered (none, bp). Every rank creates
        every CP group, in the same order (dist.new_group is collective over the world)."""
        mine = None
        for ranks in self.cp_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks (identity for one process)."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
