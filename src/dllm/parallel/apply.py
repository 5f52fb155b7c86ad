"""Apply parallelism to a single-device model, in a fixed order: context/block parallelism (each
layer's attention backend) -> compile -> FSDP2 (on the meta device, before weights exist) ...
materialize ... DDP (which needs real weights).

(Tensor parallelism and activation checkpointing slot in before compile: TP before CP/BP.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from dllm.config.training import TopologyConfig
from dllm.parallel.checkpointing import apply_activation_checkpointing
from dllm.parallel.context import ShardPlan, apply_context_parallel
from dllm.parallel.dims import ParallelDims


def apply_parallelism(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    cfg: TopologyConfig,
    compile: bool,
    plan: ShardPlan | None = None,
    cp_group: dist.ProcessGroup | None = None,
    activation_checkpointing: str = "none",
) -> nn.Module:
    """`plan`: this rank's context/block shard plan (None: every rank sees whole sequences); its
    attention exchanges K/V over `cp_group`. Before compile, so the compiled blocks trace it.
    `activation_checkpointing`: none, selective or full (parallel/checkpointing.py), after CP."""
    if plan is not None:
        apply_context_parallel(model, plan, cp_group, cfg.context.transport)
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        for block in model.layers:
            block.compile()  # in place: parameter names (and checkpoints) stay the same
    if mesh is not None and cfg.data_parallel == "fsdp":
        # per block, then the root (embeddings, final norm, head): FSDP2's recommended granularity
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def wrap_replicated(model: nn.Module, mesh: DeviceMesh | None, cfg: TopologyConfig) -> nn.Module:
    """DDP wraps a materialized model (it broadcasts rank 0's parameters), so it comes last."""
    if mesh is None or cfg.data_parallel != "ddp":
        return model
    device_ids = None if mesh.device_type == "cpu" else [torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh.get_group("dp"))


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies modules in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient all-reduce on accumulation micro-steps (DDP handled by `no_sync`)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
