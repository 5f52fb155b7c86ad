"""Tensor and sequence parallelism of the native Transformer, with DTensor
(torch.distributed.tensor.parallel), applied from outside: the model code stays single-device.

Layout over a 1-D tensor-parallel mesh of T ranks (Megatron-LM, Shoeybi et al. 2019; sequence
parallelism: Korthikanti et al. 2022):
- q/k/v, gate and up projections column-wise (each rank computes H/T query heads, K/T key/value
  heads and mlp_size/T of the MLP width); the output and down projections row-wise, so each block
  needs one all-reduce (or, with sequence parallelism, one reduce-scatter) after attention and one
  after the MLP, and one all-gather before each (sequence parallel) in forward, mirrored in backward;
- the token embedding vocabulary-parallel (rows of the table sharded; the partial lookups summed);
  the output head's weight sharded by vocabulary too (the tied embedding is that same table), and
  the cross-entropy of models/chunked_ce.py computes the softmax over the sharded vocabulary with
  two small all-reduces per chunk, so full logits never exist on any rank;
- with sequence parallelism, the norms and the residual stream between blocks hold L/T positions
  per rank; the embedding output is split after the learned positions and the embedding norm are
  added, and the final norm's output is gathered back, so the objective sees whole sequences.

Norm weights, learned positions, biases of row-wise layers and everything not listed stay
replicated; their gradients are the same on every rank of the group (DTensor reduces the partial
input gradients of the column-wise layers).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


class ReplicatedKVHeads(ParallelStyle):
    """A key or value projection with fewer heads K than tensor-parallel ranks T (T a multiple of K):
    its weight stays whole on every rank, and each rank keeps the one head that its H/T query heads
    read (rank t: head t // (T / K)), as Megatron-LM replicates key/value heads. The output's gradient
    on a rank covers its head only; the backward of `_KeepHead` sums those over the ranks (one
    all-reduce), so the replicated weight gets the whole gradient on every rank."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, input_fn=self._input, output_fn=self._output)

    @staticmethod
    def _input(module: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if isinstance(x, DTensor):
            x = x.redistribute(mesh, (Replicate(),))
        else:
            x = DTensor.from_local(x, mesh, (Replicate(),), run_check=False)
        return (x, *inputs[1:])

    def _output(self, module: nn.Module, out: DTensor, mesh: DeviceMesh) -> Any:
        head = mesh.get_local_rank() // (mesh.size() // self.kv_heads)
        return _KeepHead.apply(out.to_local(), head * self.head_dim, self.head_dim, mesh.get_group())


class _KeepHead(torch.autograd.Function):
    """Columns [start, start + width) of a replicated tensor; backward: the whole tensor's gradient,
    summed over `group` (each rank's gradient covers only the columns it kept)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, start: int, width: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.shape, ctx.cols, ctx.group = x.shape, (start, width), group
        return x[..., start : start + width].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        start, width = ctx.cols
        full = grad.new_zeros(ctx.shape)
        full[..., start : start + width] = grad
        dist.all_reduce(full, group=ctx.group)
        return full, None, None, None


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """Shard `model` (a dllm.models.Transformer, dense MLPs) in place over `tp_mesh`. The sizes were
    checked by config.rules.check_tensor_parallel: T divides the query heads, the MLP width and the
    vocabulary, and the key/value heads (or is a multiple of them: ReplicatedKVHeads), and (sequence
    parallel) the rows of every rank's input."""
    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    cfg, T = model.cfg, tp_mesh.size()
    kv_style = ColwiseParallel if cfg.kv_heads % T == 0 else lambda: ReplicatedKVHeads(cfg.kv_heads, cfg.dim_per_head)
    parallelize_module(model, tp_mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate())})
    if model.lm_head is not None:  # untied head: its weight is read by `head()`, sharded by vocabulary
        parallelize_module(model, tp_mesh, {"lm_head": ColwiseParallel()})
    for block in model.layers:
        plan: dict = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": kv_style(),
            "self_attn.v_proj": kv_style(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=between),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=between),
        }
        if block.mlp.gate_proj is None:
            del plan["mlp.gate_proj"]
        if sequence_parallel:
            # norms on L/T rows; attention and MLP gather their input once (one DTensor flows into
            # all of q/k/v, so the backward reduce-scatters the three input gradients together)
            none4 = (None,) * 4
            plan |= {
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_layouts=(Shard(1), *none4), desired_input_layouts=(Replicate(), *none4)
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        parallelize_module(block, tp_mesh, plan)
    if sequence_parallel:
        none4 = (None,) * 4
        parallelize_module(
            model.layers[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), *none4), desired_input_layouts=(Shard(1), *none4), use_local_output=True
            ),
        )
        parallelize_module(model, tp_mesh, {"norm": SequenceParallel()})
        parallelize_module(
            model,
            tp_mesh,
            {"norm": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())},
        )
        model.trim_last_block = False  # a rank's rows are not the first `num_outputs` positions


def align_grad_layouts(model: nn.Module) -> None:
    """After the weights are materialized (to_empty drops tensor hooks): every DTensor parameter's
    gradient arrives laid out as the parameter (see `_as_param`)."""
    for param in model.parameters():
        if isinstance(param, DTensor):
            param.register_hook(functools.partial(_as_param, param.device_mesh, param.placements))


def _as_param(mesh: DeviceMesh, placements: tuple, grad: torch.Tensor) -> torch.Tensor:
    """A gradient laid out as its parameter. DTensor's embedding backward may leave a vocabulary-sharded
    table's gradient replicated, on some ranks and not others; the optimizer then mixes layouts (FSDP2
    redistributes its own; a tensor-parallel run without it gets it here)."""
    if isinstance(grad, DTensor) and grad.placements != placements:
        return grad.redistribute(mesh, placements)
    return grad
