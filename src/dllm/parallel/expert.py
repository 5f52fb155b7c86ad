"""Expert parallelism (EP) for mixture-of-experts layers (models/moe.py `MoE`, `Experts`).

The model stays single-device; `apply_expert_parallel(model, ep_mesh)` changes every `Experts`
module from outside, in place (parameter and module names unchanged):

1. Placement: `gate_up_proj` [X, 2I, E] and `down_proj` [X, E, I] become DTensors `Shard(0)` over
   the 1-D `ep_mesh` (the ep ranks of this rank's expert group): ep rank r holds experts
   [r X/ep, (r+1) X/ep). The slicing is local (no communication), so it works on the meta device;
   `to_empty` + `set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)` then fills
   each rank's experts from the full tensors (training/build.py `materialize`), and
   `get_model_state_dict(full_state_dict=True)` gives the full tensors back under the same names.
2. Dispatch (`expert_parallel_forward`, installed as the instance's `forward`): this rank's N x K
   (token, slot) assignments are sorted by expert and counted per expert; the counts go to each
   expert's owner (all_to_all_single, X/ep per rank), which tells every rank how many rows each peer
   sends it and, since rows travel sorted by expert, which local expert each row is for. The token
   rows then go out (`all_to_all`: all_to_all_single whose backward is the reverse exchange), the
   owner runs its local experts on what arrived, sends the results back the same way, and the
   source rank combines them weighted by its routing weights (index_add, as the dense loop does).
   Every rank runs every collective in the forward and the backward, whatever its counts: a local
   expert with no rows still runs (an empty matmul) so its weights and the exchanged rows stay in
   the autograd graph, and the backward's reverse exchanges run on every rank.
3. The router (`MoE.gate`) and everything else stay replicated (data-parallel); the router's
   load-balancing loss is computed from each rank's own tokens, exactly as in data parallelism.

Gradient semantics (ep ranks are data-parallel ranks: each reads different data). Let each rank's
loss be L_r = (its loss sum) / (global target count) [+ coef x aux_r / W for the router's loss of
its own tokens, W data-parallel ranks], so that the one-process loss of the global batch, run as W
micro-batches, is sum_r L_r. After `backward` on every rank:
- dense parameter (replicated): rank r holds dL_r/dθ; the SUM over all W data-parallel ranks is the
  one-process gradient (what FSDP/DDP compute, up to their 1/W averaging);
- expert parameter: only its owner holds it, and the owner's gradient already sums
  d L_s / dθ over every rank s of its ep group (the reverse exchange brings back the gradient of
  every token routed to it); with DP x EP (W = edp x ep ranks; edp = W/ep groups), the ranks with
  the same ep index in the other groups hold replicas of the same experts, and only the SUM over
  those edp replicas is left to do.
So a caller sums dense gradients over the W data-parallel ranks and expert gradients over the edp
replicas. With FSDP2 and the trainer's loss scale W / global_targets (its `scale`, FSDP averaging
over W), the dense parameters are sharded over the whole dp mesh as today, and the experts over the
edp mesh with a gradient divide factor W instead of edp (their gradient already sums ep ranks):
`shard_experts(model, edp_mesh, W)` below, called before the blocks' `fully_shard`. The gradients
then live on two meshes, which `torch.nn.utils.clip_grad_norm_` refuses: parallel/grad_norm.py
groups them by mesh and placements.

Shapes: N tokens of this rank, K experts per token (top-k), A = N K assignments, R rows received,
E hidden, X experts, G ep ranks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from dllm.errors import ConfigError
from dllm.models.moe import Experts


@dataclass(frozen=True)
class EPGroup:
    """The ep group of one rank: its process group, index and size, and experts per rank."""

    group: dist.ProcessGroup
    rank: int
    size: int
    num_local: int


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> nn.Module:
    """Shard every MoE layer's experts over `ep_mesh` (1-D) and replace their forward by the
    token dispatch; in place, on a meta or a real model (a real one must be identical on the ep
    ranks: each keeps its slice)."""
    if ep_mesh.ndim != 1:
        raise ValueError(f"expert parallelism needs a 1-D mesh of ep ranks, got {ep_mesh.ndim} dimensions")
    layers = [m for m in model.modules() if isinstance(m, Experts)]
    if not layers:
        raise ConfigError("topology.ep_size > 1 needs a mixture-of-experts model; set model.num_experts or ep_size: 1")
    size = ep_mesh.size()
    num_experts = layers[0].gate_up_proj.shape[0]
    if num_experts % size:
        raise ConfigError(f"topology.ep_size {size} does not divide model.num_experts {num_experts}; change one")
    ep = EPGroup(ep_mesh.get_group(), ep_mesh.get_local_rank(), size, num_experts // size)
    for experts in layers:
        for name in ("gate_up_proj", "down_proj"):
            setattr(experts, name, _shard_rows(getattr(experts, name), ep_mesh, ep))
        experts.forward = functools.partial(expert_parallel_forward, experts, ep)
    return model


def shard_experts(model: nn.Module, edp_mesh: DeviceMesh, divide_factor: float, **fsdp_kwargs) -> None:
    """FSDP2 over the edp replicas for every `Experts` module of an EP model (before the blocks'
    `fully_shard`, which then leaves the experts' parameters alone). `divide_factor`: what FSDP
    divides the dense gradients by (the dp ranks W), since an owner's gradient already sums its ep
    group. `edp_mesh` and the ep mesh must be dimensions of one DeviceMesh (FSDP2's rule)."""
    for experts in model.modules():
        if isinstance(experts, Experts):
            fully_shard(experts, mesh=edp_mesh, **fsdp_kwargs)
            experts.set_gradient_divide_factor(divide_factor)
            # gloo has no PREMUL_SUM: sum, then divide. Not on one replica: there torch 2.13 divides
            # twice with forced sums (by the factor, then again after its skipped reduce-scatter)
            experts.set_force_sum_reduction_for_comms(edp_mesh.device_type == "cpu" and edp_mesh.size() > 1)


def _shard_rows(param: nn.Parameter, mesh: DeviceMesh, ep: EPGroup) -> nn.Parameter:
    """This rank's experts of a full [X, ...] parameter, as a Shard(0) DTensor (a local slice:
    no communication, so meta tensors work)."""
    start = ep.rank * ep.num_local
    local = param.detach()[start : start + ep.num_local].clone()
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())
    return nn.Parameter(dt, requires_grad=param.requires_grad)


def expert_parallel_forward(
    experts: Experts, ep: EPGroup, x_NE: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor
) -> torch.Tensor:
    """`Experts.forward` over the ep group: dispatch, local experts, return, weighted combine."""
    K = experts_NK.shape[1]
    expert_A, order_A = experts_NK.flatten().sort(stable=True)  # assignment a = n K + k
    token_A = order_A // K
    # rows per expert, exchanged per owner: rank g receives [X/ep] counts from each rank, so it knows
    # both how many rows arrive from each rank and, since they arrive sorted, each row's local expert
    send_X = torch.bincount(expert_A, minlength=ep.size * ep.num_local)
    recv_GX = torch.empty_like(send_X)
    dist.all_to_all_single(recv_GX, send_X, group=ep.group)
    recv_GX = recv_GX.view(ep.size, ep.num_local)
    send = send_X.view(ep.size, ep.num_local).sum(1).tolist()  # split sizes are host integers
    recv = recv_GX.sum(1).tolist()
    x_RE = all_to_all(x_NE[token_A], recv, send, ep.group)
    local_R = torch.arange(ep.num_local, device=x_NE.device).repeat(ep.size).repeat_interleave(recv_GX.flatten())
    y_RE = _run_local_experts(experts, x_RE, local_R, recv_GX.sum(0).tolist())
    y_AE = all_to_all(y_RE, send, recv, ep.group) * weights_NK.flatten()[order_A, None]
    return torch.zeros_like(x_NE).index_add_(0, token_A, y_AE.to(x_NE.dtype))


def _run_local_experts(experts: Experts, x_RE: torch.Tensor, local_R: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Each received row through its local expert (`counts` rows each), in the order received. Every
    local expert runs, with no rows too: its weights then get a zero gradient and the rows stay in the
    graph."""
    gate_up, down = experts.gate_up_proj.to_local(), experts.down_proj.to_local()
    order_R = local_R.argsort(stable=True)
    outs = []
    for j, rows in enumerate(order_R.split(counts)):
        gate, up = F.linear(x_RE[rows], gate_up[j]).chunk(2, dim=-1)
        outs.append(F.linear(experts.act(gate) * up, down[j]))
    y_sorted = torch.cat(outs)
    return y_sorted.new_zeros(y_sorted.shape).index_copy(0, order_R, y_sorted)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single along dim 0 with uneven splits; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        return _exchange(grad, in_splits, out_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of `x` in `in_splits` chunks to the group's ranks, rows received in `out_splits` chunks
    (autograd-aware: the gradient travels back the reverse way)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)
