"""Apply parallelism to a single-device model, in one fixed order: tensor/sequence parallelism
(DTensor shards of each layer) and expert parallelism (experts sharded, tokens dispatched) ->
context/block parallelism (each layer's attention backend) ->
activation checkpointing -> compile (per block) -> FSDP2 (on the meta device, before weights exist)
... materialize ... DDP (which needs real weights).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from dllm.config.training import TopologyConfig
from dllm.parallel.context import ShardPlan, apply_context_parallel
from dllm.parallel.dims import ParallelDims
from dllm.parallel.expert import apply_expert_parallel, shard_experts
from dllm.parallel.tensor import apply_tensor_parallel


def apply_parallelism(
    model: nn.Module,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    cfg: TopologyConfig,
    compile: bool,
    plan: ShardPlan | None = None,
    cp_group: dist.ProcessGroup | None = None,
    ep_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """`plan`: this rank's context/block shard plan (None: every rank sees whole sequences); its
    attention exchanges K/V over `cp_group`. Before compile, so the compiled blocks trace it."""
    if dims.tp > 1:
        assert mesh is not None
        apply_tensor_parallel(model, mesh["tp"], dims.sequence_parallel)
    if ep_mesh is not None:  # ParallelDims.build_ep_mesh: ("edp", "ep")
        apply_expert_parallel(model, ep_mesh["ep"])
    if plan is not None:
        apply_context_parallel(model, plan, cp_group, cfg.context.transport)
    if compile:
        for block in model.layers:
            block.compile()  # in place: parameter names (and checkpoints) stay the same
    if mesh is not None and cfg.data_parallel == "fsdp" and dims.grad_ranks > 1:
        # per block, then the root (embeddings, final norm, head): FSDP2's recommended granularity
        dp_mesh = data_parallel_mesh(mesh, dims)
        if ep_mesh is not None:  # experts first, over their replicas; an owner's gradient sums its ep group
            shard_experts(model, ep_mesh["edp"], dims.grad_ranks)
        for block in model.layers:
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def data_parallel_mesh(mesh: DeviceMesh, dims: ParallelDims) -> DeviceMesh:
    """FSDP2's mesh: shard over dp_shard x cp, and (HSDP) replicate over dp_replicate."""
    return mesh["dp_replicate", "dp_shard_cp"] if dims.dp_replicate > 1 else mesh["dp_shard_cp"]


def wrap_replicated(model: nn.Module, mesh: DeviceMesh | None, cfg: TopologyConfig) -> nn.Module:
    """DDP wraps a materialized model (it broadcasts rank 0's parameters), so it comes last."""
    if mesh is None or cfg.data_parallel != "ddp":
        return model
    device_ids = None if mesh.device_type == "cpu" else [torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, process_group=mesh["dp_cp"].get_group())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies modules in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient all-reduce on accumulation micro-steps (DDP handled by `no_sync`)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
