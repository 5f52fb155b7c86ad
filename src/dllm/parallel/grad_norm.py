"""The global gradient norm, and clipping to it, over parameters that may be DTensors on different
meshes (FSDP2's data-parallel shards, tensor-parallel shards, expert shards) or plain tensors.

torch.nn.utils.clip_grad_norm_ needs every gradient on one mesh; with tensor parallelism without
FSDP some parameters are plain (replicated norms) and others DTensors, and expert parallelism puts
expert weights on a mesh of their own. Here the gradients are grouped by (mesh, placements); each
group's local sum of squares is summed over the mesh dimensions it is sharded (or partial) along,
and not over those it is replicated along, so every element of the full gradient counts once.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def global_grad_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """sqrt(sum over every element of every full gradient of its square), the same on every rank."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    meshes: dict[tuple, DTensor] = {}
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            key = (id(g.device_mesh), g.placements)
            meshes.setdefault(key, g)
            groups.setdefault(key, []).append(g.to_local())
        else:
            groups.setdefault((), []).append(g)
    total = None
    for key, grads in groups.items():
        sq = torch.nn.utils.get_total_norm(grads).float() ** 2  # foreach kernels, not one norm per tensor
        if key:
            spec = meshes[key]
            for dim, placement in enumerate(spec.placements):
                if not isinstance(placement, Replicate):
                    dist.all_reduce(sq, group=spec.device_mesh.get_group(dim))
        total = sq if total is None else total + sq.to(total.device)
    return torch.zeros(()) if total is None else total.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale every gradient so that the global norm is at most `max_norm`; returns the norm before."""
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for g in locals_:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    for (device, dtype), grads in by_kind.items():
        torch._foreach_mul_(grads, coef.to(device, dtype))  # what torch's clip_grad_norm_ does
    return norm
