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
    """Sizes of each parallel dimension: world = dp_replicate x dp_shard x group x tp, where a context
    group of `group` ranks shares each sequence (`topology.context`; group 1 without context/block
    parallelism), `tp` ranks split each layer (tensor parallelism), and ep of the dp ranks split the
    experts of an MoE model (expert parallelism borrows data-parallel ranks: they read different data).

    World rank w = ((d * group) + g) * tp + t, with d = r * dp_shard + s the data-parallel index: the
    tp ranks of a layer are consecutive (one node's fast links), then the context group, then data
    parallelism outermost. Gradients are reduced over the dp x group ranks of one tensor-parallel
    index (FSDP2 over the flattened "dp_shard_cp" mesh dimension, HSDP: replicated over
    "dp_replicate"); the CP process groups (cp, csbp) are separate communicators.
    """

    dp: int
    world_size: int
    mode: Literal["none", "cp", "bp", "csbp"] = "none"
    cp: int = 1
    bp: int = 1
    tp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    sequence_parallel: bool = False

    @classmethod
    def from_topology(cls, cfg: TopologyConfig, world_size: int) -> ParallelDims:
        ctx = cfg.context
        group = ctx.group_size
        dp = world_size // (group * cfg.tp_size) if cfg.dp_size == -1 else cfg.dp_size
        assert dp * group * cfg.tp_size == world_size, "checked by config rules"
        sizes = dict(
            tp=cfg.tp_size, ep=cfg.ep_size, dp_replicate=cfg.dp_replicate,
            sequence_parallel=cfg.sequence_parallel and cfg.tp_size > 1,
        )  # fmt: skip
        if group == 1:  # cp_size 1 or bp_size 1: nothing to split (preflight warns)
            return cls(dp=dp, world_size=world_size, **sizes)
        return cls(dp=dp, world_size=world_size, mode=ctx.mode, cp=ctx.cp_size, bp=ctx.bp_size, **sizes)

    @property
    def group(self) -> int:
        """Ranks that share one sequence: cp (cp), bp (bp, csbp), 1 (none)."""
        return {"none": 1, "cp": self.cp}.get(self.mode, self.bp)

    @property
    def dp_shard(self) -> int:
        return self.dp // self.dp_replicate

    @property
    def grad_ranks(self) -> int:
        """Ranks over which FSDP/DDP average a gradient: dp x group (the tp ranks hold other shards)."""
        return self.dp * self.group

    def dp_index(self, rank: int) -> int:
        """The data-parallel index of a world rank: which share of the global batch it reads."""
        return rank // (self.group * self.tp)

    def group_rank(self, rank: int) -> int:
        """A world rank's index inside its context group (the rank of its ShardPlan)."""
        return (rank // self.tp) % self.group

    def cp_groups(self) -> list[list[int]]:
        """World ranks of every CP process group (cp, csbp): per data-parallel and tensor-parallel
        index, its context group cut into runs of cp consecutive group ranks
        (parallel.context.cp_group_ranks), in one fixed order."""
        if self.mode not in ("cp", "csbp"):
            return []
        return [
            [((d * self.group) + base + i) * self.tp + t for i in range(self.cp)]
            for d in range(self.dp)
            for t in range(self.tp)
            for base in range(0, self.group, self.cp)
        ]

    def build_meshes(self, device: torch.device) -> Meshes | None:
        """Every view of the world this run uses, unflattened from one 1-D world mesh (so they share
        a root, as FSDP2 over tensor- or expert-parallel DTensors requires); None for one process."""
        if self.world_size == 1:
            return None
        world = init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("world",))
        named = world._unflatten(
            0, (self.dp_replicate, self.dp_shard, self.group, self.tp), ("dp_replicate", "dp_shard", "cp", "tp")
        )
        dense = world._unflatten(
            0, (self.dp_replicate, self.dp_shard * self.group, self.tp), ("dp_replicate", "dp_shard_cp", "tp")
        )
        fsdp = dense["dp_replicate", "dp_shard_cp"] if self.dp_replicate > 1 else dense["dp_shard_cp"]
        dp_cp = world._unflatten(0, (self.dp * self.group, self.tp), ("dp_cp", "tp"))["dp_cp"]
        ep = None
        if self.ep > 1:  # tp = group = 1 (config rules): the data-parallel ranks, ep consecutive ones
            ep = world._unflatten(0, (self.dp // self.ep, self.ep), ("edp", "ep"))
        return Meshes(named=named, fsdp=fsdp, tp=dense["tp"], dp_cp=dp_cp, ep=ep)

    def build_cp_group(self, rank: int) -> dist.ProcessGroup | None:
        """This rank's CP process group, None when nothing is gathered (none, bp). Every rank creates
        every CP group, in the same order (dist.new_group is collective over the world)."""
        mine = None
        for ranks in self.cp_groups():
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = group
        return mine


@dataclass(frozen=True)
class Meshes:
    """The device meshes of one run (ParallelDims.build_meshes)."""

    named: DeviceMesh
    """("dp_replicate", "dp_shard", "cp", "tp"): every axis by name."""
    fsdp: DeviceMesh
    """FSDP2's mesh: "dp_shard_cp" (data-parallel and context ranks shard parameters), with
    "dp_replicate" in front for HSDP."""
    tp: DeviceMesh
    """This rank's tensor-parallel ranks."""
    dp_cp: DeviceMesh
    """Every rank of this tensor-parallel index: DDP's process group."""
    ep: DeviceMesh | None
    """("edp", "ep") for expert parallelism: the ep ranks that split the experts, and the replicas of
    each expert shard."""


def all_reduce_sum(t: torch.Tensor, env: DistEnv) -> torch.Tensor:
    """Sum a tensor over ranks (identity for one process)."""
    if env.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(env: DistEnv) -> None:
    if env.distributed:
        dist.barrier()
