"""Apply parallelism to a single-device model, in one fixed order: tensor/sequence parallelism
(DTensor shards of each layer) and expert parallelism (experts sharded, tokens dispatched) ->
context/block parallelism (each layer's attention backend) ->
activation checkpointing -> compile (per block) -> FSDP2 (on the meta device, before weights exist)
... materialize ... `after_materialize` (gradient-layout hooks, DDP: they need real weights).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel

from dllm.config.training import TopologyConfig
from dllm.parallel.checkpointing import apply_activation_checkpointing
from dllm.parallel.context import ShardPlan
from dllm.parallel.context_attention import apply_context_parallel
from dllm.parallel.dims import Meshes, ParallelDims
from dllm.parallel.expert import apply_expert_parallel, shard_experts
from dllm.parallel.tensor import align_grad_layouts, apply_tensor_parallel


def apply_parallelism(
    model: nn.Module,
    dims: ParallelDims,
    meshes: Meshes | None,
    cfg: TopologyConfig,
    compile: bool,
    plan: ShardPlan | None = None,
    cp_group: dist.ProcessGroup | None = None,
    activation_checkpointing: str = "none",
) -> nn.Module:
    """`plan`: this rank's context/block shard plan (None: every rank sees whole sequences); its
    attention exchanges K/V over `cp_group`. Before compile, so the compiled blocks trace it.
    `activation_checkpointing`: none, selective or full (parallel/checkpointing.py), after CP."""
    if meshes is not None and dims.tp > 1:
        apply_tensor_parallel(model, meshes.tp, dims.sequence_parallel)
    if meshes is not None and meshes.ep is not None:
        apply_expert_parallel(model, meshes.ep["ep"])
    if plan is not None:
        apply_context_parallel(model, plan, cp_group, cfg.context.transport)
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        if dims.tp > 1:
            model.embed_tokens.register_forward_hook(_fresh_output)
        if dims.tp > 1 or plan is not None or (meshes is not None and meshes.ep is not None):
            _no_autograd_cache()
        for block in model.layers:
            block.compile()  # in place: parameter names (and checkpoints) stay the same
    if meshes is not None and cfg.data_parallel == "fsdp" and dims.grad_ranks > 1:
        if meshes.ep is not None:  # experts first, over their replicas; an owner's gradient sums its ep group
            shard_experts(model, meshes.ep["edp"], dims.grad_ranks)
        # per block, then the root (embeddings, final norm, head): FSDP2's recommended granularity
        for block in model.layers:
            fully_shard(block, mesh=meshes.fsdp)
        fully_shard(model, mesh=meshes.fsdp)
    return model


def _no_autograd_cache() -> None:
    """Turns off AOTAutograd's on-disk cache in this process when the compiled blocks hold collectives
    (tensor, expert or context parallel). Its key does not see the process group a collective runs on,
    while the cached code names the group: a later run whose groups are named otherwise loads it and
    fails with "Could not resolve the process group registered under the name N" (measured, torch
    2.13: the TP parity tests pass with a cold cache and fail when rerun with the same cache).
    Inductor's own FX graph cache, which keys on the code with the group names in it, stays on."""
    torch._functorch.config.enable_autograd_cache = False


def _fresh_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """The vocabulary-parallel embedding's output as a tensor of its own. It is a view of a DTensor's
    local tensor (`to_local`), and a compiled block that takes such a view as its input replays the view
    from its base, which cuts the gradient's path back to the embedding (measured, torch 2.13: the
    embedding's gradient came out zero with sequence parallelism, and the backward failed without it)."""
    return output.clone()


def after_materialize(model: nn.Module, meshes: Meshes | None, cfg: TopologyConfig) -> nn.Module:
    """What needs real weights: gradient-layout hooks of tensor-parallel parameters (FSDP2 lays out
    its own), and DDP, which broadcasts rank 0's parameters, so it comes last."""
    if cfg.tp_size > 1 and not isinstance(model, FSDPModule):
        align_grad_layouts(model)
    if meshes is None or cfg.data_parallel != "ddp":
        return model
    device_ids = None if meshes.dp_cp.device_type == "cpu" else [torch.cuda.current_device()]
    return DistributedDataParallel(model, device_ids=device_ids, process_group=meshes.dp_cp.get_group())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under a DDP wrapper (FSDP2 modifies modules in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def grad_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager:
    """A micro-batch's context: gradients are reduced over the data-parallel ranks only on the `last`
    micro-batch of an accumulation (FSDP2's flag; DDP's `no_sync` around the others)."""
    set_grad_sync(model, last)
    no_sync = getattr(model, "no_sync", None)  # DDP
    return contextlib.nullcontext() if last or no_sync is None else no_sync()


def set_grad_sync(model: nn.Module, enabled: bool) -> None:
    """Skip the gradient all-reduce on accumulation micro-steps (DDP handled by `no_sync`)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
