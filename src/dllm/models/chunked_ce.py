"""LM head + cross-entropy in row chunks, so the full [N, V] logits never exist (forward or backward).

For N rows of hidden states, a head weight [V, E] and target ids, the loss is
`sum_n w_n * CE(h_n W^T + b, t_n)`. Materialising the logits costs N * V floats (8k tokens at a 152k
vocabulary is 5 GB in float32), and autograd keeps them, their softmax and their gradient alive.
Here the rows are processed in chunks: each chunk's logits are computed in float32, reduced to a
log-sum-exp and a CE, and turned at once into the gradient of the loss w.r.t. those logits,
`w_n * (softmax - onehot)`; that gradient is multiplied into the gradients of the hidden rows and of
the weight (and bias), and the chunk is freed. Only those input-sized gradients are kept for
backward, which merely scales them by the incoming gradient. This is the "fused linear cross entropy"
of Liger-Kernel (Hsu et al. 2024, arXiv:2410.10989), written here in plain PyTorch.

Semantics (`plain_cross_entropy` is the reference that spells them out):
- logits are computed in float32 (float64 if an input is float64), also under autocast;
- the ids in `exclude_ids` get logit -inf: they are never valid predictions (the mask token of
  masked diffusion, Sahoo et al. 2024 / Nie et al. 2025); a target in `exclude_ids` has CE inf;
- every target must be a valid id (no ignore_index): leave a row out with weight 0;
- `softcap`: the logits are cap * tanh(logits / cap) before the excluded ids and the CE (Gemma's final
  soft-capping); the chunked gradient goes through the tanh (times 1 - tanh^2);
- returns `(weighted_sum, ce_N)`: the weighted sum is differentiable w.r.t. hidden, weight, bias and
  weights; `ce_N` is the per-row CE, detached, for metrics;
- `certainty` (certainty forcing, dParallel: Chen et al. 2025, arXiv:2509.26488): the weighted sum also
  holds `certainty.weight * sum_n H_T(n)` over the rows n with a positive weight whose target already has
  the largest logit, H_T the entropy of softmax(logits / temperature) over the valid ids. Minimising it
  sharpens predictions the model already gets right, so more masked tokens pass a confidence threshold
  at once when decoding. Then four values come back: also `entropy_N` (H_T per row, detached) and
  `forced_N` (which rows were in the term). The chunked gradient of H_T w.r.t. the logits is
  -(1 / T) p (log p + H_T), p = softmax(logits / T), added to the CE's before the soft-cap's tanh factor.

Vocabulary parallelism: when the weight is a DTensor sharded by rows (Shard(0)) over a 1-D
tensor-parallel mesh (parallel/tensor.py), each rank holds V/T rows of the head and the same hidden
rows. Per chunk it computes its V/T logits; the row maxima are all-reduced (max), then the sums of
exp(logit - max) and the target logits (the one rank whose shard holds the target contributes it)
in one all-reduce (sum), so every rank gets the same CE. The logits gradient of a shard is its own
slice of softmax - onehot; the hidden rows' gradient is a sum over the shards, all-reduced once after
the loop; the weight gradient stays sharded. The full [N, V] logits exist nowhere.

Shapes: N rows (supervised positions), E hidden width, V vocabulary, C rows in a chunk, X excluded ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

CHUNK_ELEMENTS = 2**23
"""Default chunk budget: rows per chunk = CHUNK_ELEMENTS // V, i.e. about 32 MiB of float32 logits."""


@dataclass(frozen=True)
class Certainty:
    """Certainty forcing: `weight` times the entropy of softmax(logits / `temperature`) on the rows the model
    already predicts right (target logit = row maximum) with a positive loss weight."""

    weight: float
    temperature: float = 0.5

    def __post_init__(self) -> None:
        if not (self.weight >= 0 and self.temperature > 0):
            raise ValueError(f"certainty forcing needs weight >= 0 and temperature > 0, got {self}")


def _tempered_entropy(logits_CV: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(H_T per row, p = softmax(logits / T), p log p with 0 at the excluded ids' -inf logits)."""
    logp_CV = torch.log_softmax(logits_CV / temperature, dim=1)
    p_CV = logp_CV.exp()
    plogp_CV = p_CV * torch.nan_to_num(logp_CV, neginf=0.0)
    return -plogp_CV.sum(1), p_CV, plogp_CV


def _forced_rows(logits_CV: torch.Tensor, target_logit_C: torch.Tensor, weights_C: torch.Tensor) -> torch.Tensor:
    """The rows in the certainty term: a positive loss weight and the target's logit is the row's largest."""
    return (target_logit_C >= logits_CV.amax(dim=1)) & (weights_C > 0)


def plain_cross_entropy(
    hidden_NE: torch.Tensor,
    weight_VE: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    exclude_ids: Sequence[int] = (),
    bias_V: torch.Tensor | None = None,
    softcap: float | None = None,
    certainty: Certainty | None = None,
) -> tuple[torch.Tensor, ...]:
    """The reference: full [N, V] logits, then CE. `chunk_size` is accepted and ignored."""
    logits_NV = F.linear(hidden_NE, weight_VE, bias_V)
    logits_NV = logits_NV.to(_compute_dtype(hidden_NE, weight_VE))
    if softcap is not None:
        logits_NV = torch.tanh(logits_NV / softcap) * softcap
    if len(exclude_ids):
        logits_NV[:, list(exclude_ids)] = float("-inf")
    ce_N = F.cross_entropy(logits_NV, targets_N, reduction="none")
    weights_N = torch.ones_like(ce_N) if weights_N is None else weights_N
    total = (ce_N * weights_N).sum()
    if certainty is None:
        return total, ce_N.detach()
    target_logit_N = logits_NV.gather(1, targets_N[:, None]).squeeze(1)
    forced_N = _forced_rows(logits_NV.detach(), target_logit_N.detach(), weights_N.detach())
    entropy_N = _tempered_entropy(logits_NV, certainty.temperature)[0]
    total = total + certainty.weight * (entropy_N * forced_N).sum()
    return total, ce_N.detach(), entropy_N.detach(), forced_N


def linear_cross_entropy(
    hidden_NE: torch.Tensor,
    weight_VE: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    exclude_ids: Sequence[int] = (),
    bias_V: torch.Tensor | None = None,
    softcap: float | None = None,
    certainty: Certainty | None = None,
) -> tuple[torch.Tensor, ...]:
    """Chunked `plain_cross_entropy`: same results, peak extra memory O(C * V + V * E + N * E).

    `chunk_size` is rows per chunk (None: CHUNK_ELEMENTS // V). Gradient buffers are only built for
    inputs that require grad while grad mode is on.
    """
    V = weight_VE.shape[0]
    C = max(1, chunk_size if chunk_size is not None else CHUNK_ELEMENTS // V)
    weights_N = torch.ones(targets_N.shape, device=hidden_NE.device) if weights_N is None else weights_N
    exclude_X = torch.tensor(list(exclude_ids), dtype=torch.long, device=hidden_NE.device)
    shard = None
    if isinstance(weight_VE, DTensor):  # vocabulary-parallel head: this rank's rows of it
        shard = VocabShard.of(weight_VE)
        weight_VE = weight_VE.to_local()  # autograd: the local gradient becomes the sharded one
        bias_V = None if bias_V is None else bias_V.to_local()
        exclude_X = exclude_X[(exclude_X >= shard.start) & (exclude_X < shard.stop)] - shard.start
        if certainty is not None:
            raise ValueError("certainty forcing is not vocabulary-parallel: set topology.tp_size: 1")
    inputs = (hidden_NE, weight_VE, bias_V, weights_N)
    needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in inputs)
    # the logits are computed in float32 whatever autocast says (cf. the fp32 loss of mixed precision)
    device_type = hidden_NE.device.type
    with torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else nullcontext():
        if not any(needs):
            weighted_sum, ce_N, _, forcing = _chunked_loss(
                hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C,
                shard=shard, softcap=softcap, certainty=certainty,
            )  # fmt: skip
            return (weighted_sum, ce_N, *forcing)
        out = _LinearCrossEntropy.apply(
            hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C, needs, shard, softcap, certainty
        )
        return out if certainty is not None else out[:2]


@dataclass(frozen=True)
class VocabShard:
    """Rows [start, stop) of a head weight sharded by vocabulary over `group`."""

    start: int
    stop: int
    group: dist.ProcessGroup

    @classmethod
    def of(cls, weight_VE: DTensor) -> VocabShard:
        mesh, placements = weight_VE.device_mesh, weight_VE.placements
        if mesh.ndim != 1 or placements != (Shard(0),):
            raise ValueError(f"a vocabulary-parallel head is Shard(0) on a 1-D mesh, got {placements} on {mesh}")
        V, T, rank = weight_VE.shape[0], mesh.size(), mesh.get_local_rank()
        rows = -(-V // T)  # DTensor's Shard: torch.chunk sizes
        start = min(rank * rows, V)
        return cls(start, min(start + rows, V), mesh.get_group())


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and all input gradients; backward scales them by d(out)/d(loss)."""

    @staticmethod
    def forward(ctx, hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C, needs, shard, cap, certainty):
        weighted_sum, ce_N, grads, forcing = _chunked_loss(
            hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C, needs, shard, cap, certainty
        )
        grad_weights_N = ce_N.to(weights_N.dtype) if needs[3] else None
        ctx.save_for_backward(*grads, grad_weights_N)
        # the certainty term's rows and entropies (empty without it): metrics, never differentiated
        extra = forcing or (ce_N.new_empty(0), ce_N.new_empty(0, dtype=torch.bool))
        ctx.mark_non_differentiable(ce_N, *extra)
        return weighted_sum, ce_N, *extra

    @staticmethod
    def backward(ctx, grad_sum, grad_ce, grad_entropy, grad_forced):
        # the loss is linear in each saved gradient's scale: d loss/d x = grad_sum * saved
        grad_h, grad_w, grad_b, grad_weights = (
            None if g is None else (g * grad_sum).to(g.dtype) for g in ctx.saved_tensors
        )
        return grad_h, grad_w, grad_b, None, grad_weights, None, None, None, None, None, None


def _chunked_loss(
    hidden_NE: torch.Tensor,
    weight_VE: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor,
    exclude_X: torch.Tensor,
    C: int,
    needs: tuple[bool, ...] = (False, False, False, False),
    shard: VocabShard | None = None,
    softcap: float | None = None,
    certainty: Certainty | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...], tuple[torch.Tensor, ...]]:
    """The one loop: per chunk, CE and (if any input needs it) the logits gradient, folded into
    grad_hidden rows, the float32 grad_weight / grad_bias accumulators. Returns input-dtype grads, and
    with `certainty` (entropy_N, forced_N) (else ()).
    `shard`: the weight holds only these vocabulary rows (see the module docstring)."""
    N = hidden_NE.shape[0]
    dtype = _compute_dtype(hidden_NE, weight_VE)
    W_VE = weight_VE.detach().to(dtype)
    b_V = None if bias_V is None else bias_V.detach().to(dtype)
    grad_h_NE = torch.empty_like(hidden_NE) if needs[0] else None
    grad_w_VE = torch.zeros_like(W_VE) if needs[1] else None
    grad_b_V = torch.zeros_like(b_V) if needs[2] and b_V is not None else None
    ce_N = torch.empty(N, dtype=dtype, device=hidden_NE.device)
    entropy_N = torch.zeros(N, dtype=dtype, device=hidden_NE.device) if certainty is not None else None
    forced_N = torch.zeros(N, dtype=torch.bool, device=hidden_NE.device) if certainty is not None else None
    for start in range(0, N, C):
        rows = slice(start, start + C)
        h_CE = hidden_NE[rows].detach().to(dtype)
        ce_N[rows], g_CV, forcing = _chunk(
            h_CE, W_VE, b_V, targets_N[rows], weights_N[rows], exclude_X, any(needs[:3]), shard, softcap, certainty
        )
        if forcing:
            entropy_N[rows], forced_N[rows] = forcing
        if grad_h_NE is not None:
            grad_h_NE[rows] = g_CV @ W_VE
        if grad_w_VE is not None:
            grad_w_VE.addmm_(g_CV.T, h_CE)
        if grad_b_V is not None:
            grad_b_V += g_CV.sum(0)
    if shard is not None and grad_h_NE is not None:
        dist.all_reduce(grad_h_NE, group=shard.group)  # every shard's share of d loss / d hidden
    weighted_sum = (ce_N * weights_N.detach().to(dtype)).sum()
    grads = (grad_h_NE, _cast(grad_w_VE, weight_VE), _cast(grad_b_V, bias_V))
    if certainty is None:
        return weighted_sum, ce_N, grads, ()
    weighted_sum = weighted_sum + certainty.weight * (entropy_N * forced_N).sum()
    return weighted_sum, ce_N, grads, (entropy_N, forced_N)


def _chunk(
    h_CE: torch.Tensor,
    W_VE: torch.Tensor,
    b_V: torch.Tensor | None,
    targets_C: torch.Tensor,
    weights_C: torch.Tensor,
    exclude_X: torch.Tensor,
    need_grad: bool,
    shard: VocabShard | None = None,
    softcap: float | None = None,
    certainty: Certainty | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """CE of C rows and d(sum w * CE)/d logits = w * (softmax - onehot), built in the logits buffer
    (times 1 - tanh^2 of the soft-capped logits); with `certainty` also its entropy term, its gradient
    -(weight / T) p (log p + H_T) on the forced rows added, and (entropy_C, forced_C)."""
    logits_CV = h_CE @ W_VE.T if b_V is None else torch.addmm(b_V, h_CE, W_VE.T)
    tanh_CV = None
    if softcap is not None:
        tanh_CV = torch.tanh(logits_CV / softcap)
        logits_CV = torch.mul(tanh_CV, softcap, out=logits_CV)
    if exclude_X.numel():
        logits_CV.index_fill_(1, exclude_X, float("-inf"))
    if shard is None:
        lse_C = torch.logsumexp(logits_CV, dim=1)
        target_logit_C = logits_CV.gather(1, targets_C[:, None]).squeeze(1)
        local_targets_C = targets_C
    else:
        lse_C, target_logit_C, local_targets_C = _sharded_lse(logits_CV, targets_C, shard)
    ce_C = lse_C - target_logit_C
    forcing, grad_entropy_CV = (), None
    if certainty is not None:  # before the softmax below overwrites the logits
        forced_C = _forced_rows(logits_CV, target_logit_C, weights_C)
        entropy_C, p_CV, plogp_CV = _tempered_entropy(logits_CV, certainty.temperature)
        forcing = (entropy_C, forced_C)
        if need_grad:
            scale_C = forced_C.to(p_CV.dtype) * (-certainty.weight / certainty.temperature)
            grad_entropy_CV = plogp_CV.add_(p_CV.mul_(entropy_C[:, None])).mul_(scale_C[:, None])
    if not need_grad:
        return ce_C, None, forcing
    grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()  # softmax, in place
    if shard is None:
        grad_CV.scatter_add_(1, targets_C[:, None], torch.full_like(lse_C[:, None], -1.0))
    else:  # the one-hot lies in this shard for the rows whose target it holds
        rows = (local_targets_C >= 0).nonzero().squeeze(1)
        grad_CV.index_put_((rows, local_targets_C[rows]), torch.full_like(lse_C[rows], -1.0), accumulate=True)
    grad_CV.mul_(weights_C.to(grad_CV.dtype)[:, None])
    if grad_entropy_CV is not None:
        grad_CV.add_(grad_entropy_CV)
    return ce_C, grad_CV if tanh_CV is None else grad_CV.mul_(1.0 - tanh_CV.square_()), forcing


def _sharded_lse(
    logits_CV: torch.Tensor, targets_C: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-sum-exp over the whole vocabulary and the target logits, from this rank's V/T columns:
    (lse, target logit, the target's local column or -1 where another shard holds it)."""
    max_C = logits_CV.amax(dim=1)
    dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=shard.group)
    max_C = torch.where(torch.isfinite(max_C), max_C, torch.zeros_like(max_C))  # a shard of excluded ids only
    owned_C = (targets_C >= shard.start) & (targets_C < shard.stop)
    local_C = torch.where(owned_C, targets_C - shard.start, -1)
    sums_2C = torch.stack(
        [
            (logits_CV - max_C[:, None]).exp().sum(1),
            torch.where(owned_C, logits_CV.gather(1, local_C.clamp_min(0)[:, None]).squeeze(1), 0.0),
        ]
    )
    dist.all_reduce(sums_2C, group=shard.group)
    return max_C + sums_2C[0].log(), sums_2C[1], local_C


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64 (so float64 tests compare exactly)."""
    return torch.promote_types(torch.float32, torch.promote_types(hidden.dtype, weight.dtype))


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)
