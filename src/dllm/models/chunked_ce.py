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
- returns `(weighted_sum, ce_N)`: the weighted sum is differentiable w.r.t. hidden, weight, bias and
  weights; `ce_N` is the per-row CE, detached, for metrics.

Shapes: N rows (supervised positions), E hidden width, V vocabulary, C rows in a chunk, X excluded ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**23
"""Default chunk budget: rows per chunk = CHUNK_ELEMENTS // V, i.e. about 32 MiB of float32 logits."""


def plain_cross_entropy(
    hidden_NE: torch.Tensor,
    weight_VE: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    exclude_ids: Sequence[int] = (),
    bias_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: full [N, V] logits, then CE. `chunk_size` is accepted and ignored."""
    logits_NV = F.linear(hidden_NE, weight_VE, bias_V)
    logits_NV = logits_NV.to(_compute_dtype(hidden_NE, weight_VE))
    if len(exclude_ids):
        logits_NV[:, list(exclude_ids)] = float("-inf")
    ce_N = F.cross_entropy(logits_NV, targets_N, reduction="none")
    weights_N = torch.ones_like(ce_N) if weights_N is None else weights_N
    return (ce_N * weights_N).sum(), ce_N.detach()


def linear_cross_entropy(
    hidden_NE: torch.Tensor,
    weight_VE: torch.Tensor,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    exclude_ids: Sequence[int] = (),
    bias_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked `plain_cross_entropy`: same results, peak extra memory O(C * V + V * E + N * E).

    `chunk_size` is rows per chunk (None: CHUNK_ELEMENTS // V). Gradient buffers are only built for
    inputs that require grad while grad mode is on.
    """
    V = weight_VE.shape[0]
    C = max(1, chunk_size if chunk_size is not None else CHUNK_ELEMENTS // V)
    weights_N = torch.ones(targets_N.shape, device=hidden_NE.device) if weights_N is None else weights_N
    exclude_X = torch.tensor(list(exclude_ids), dtype=torch.long, device=hidden_NE.device)
    inputs = (hidden_NE, weight_VE, bias_V, weights_N)
    needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in inputs)
    # the logits are computed in float32 whatever autocast says (cf. the fp32 loss of mixed precision)
    device_type = hidden_NE.device.type
    with torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else nullcontext():
        if not any(needs):
            weighted_sum, ce_N, _ = _chunked_loss(hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C)
            return weighted_sum, ce_N
        return _LinearCrossEntropy.apply(hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C, needs)


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward computes the loss and all input gradients; backward scales them by d(out)/d(loss)."""

    @staticmethod
    def forward(ctx, hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C, needs):
        weighted_sum, ce_N, grads = _chunked_loss(
            hidden_NE, weight_VE, bias_V, targets_N, weights_N, exclude_X, C, needs
        )
        grad_weights_N = ce_N.to(weights_N.dtype) if needs[3] else None
        ctx.save_for_backward(*grads, grad_weights_N)
        ctx.mark_non_differentiable(ce_N)
        return weighted_sum, ce_N

    @staticmethod
    def backward(ctx, grad_sum, grad_ce):
        # the loss is linear in each saved gradient's scale: d loss/d x = grad_sum * saved
        grad_h, grad_w, grad_b, grad_weights = (
            None if g is None else (g * grad_sum).to(g.dtype) for g in ctx.saved_tensors
        )
        return grad_h, grad_w, grad_b, None, grad_weights, None, None, None


def _chunked_loss(
    hidden_NE: torch.Tensor,
    weight_VE: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    weights_N: torch.Tensor,
    exclude_X: torch.Tensor,
    C: int,
    needs: tuple[bool, ...] = (False, False, False, False),
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """The one loop: per chunk, CE and (if any input needs it) the logits gradient, folded into
    grad_hidden rows, the float32 grad_weight / grad_bias accumulators. Returns input-dtype grads."""
    N = hidden_NE.shape[0]
    dtype = _compute_dtype(hidden_NE, weight_VE)
    W_VE = weight_VE.detach().to(dtype)
    b_V = None if bias_V is None else bias_V.detach().to(dtype)
    grad_h_NE = torch.empty_like(hidden_NE) if needs[0] else None
    grad_w_VE = torch.zeros_like(W_VE) if needs[1] else None
    grad_b_V = torch.zeros_like(b_V) if needs[2] and b_V is not None else None
    ce_N = torch.empty(N, dtype=dtype, device=hidden_NE.device)
    for start in range(0, N, C):
        rows = slice(start, start + C)
        h_CE = hidden_NE[rows].detach().to(dtype)
        ce_N[rows], g_CV = _chunk(h_CE, W_VE, b_V, targets_N[rows], weights_N[rows], exclude_X, any(needs[:3]))
        if grad_h_NE is not None:
            grad_h_NE[rows] = g_CV @ W_VE
        if grad_w_VE is not None:
            grad_w_VE.addmm_(g_CV.T, h_CE)
        if grad_b_V is not None:
            grad_b_V += g_CV.sum(0)
    weighted_sum = (ce_N * weights_N.detach().to(dtype)).sum()
    grads = (grad_h_NE, _cast(grad_w_VE, weight_VE), _cast(grad_b_V, bias_V))
    return weighted_sum, ce_N, grads


def _chunk(
    h_CE: torch.Tensor,
    W_VE: torch.Tensor,
    b_V: torch.Tensor | None,
    targets_C: torch.Tensor,
    weights_C: torch.Tensor,
    exclude_X: torch.Tensor,
    need_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CE of C rows and d(sum w * CE)/d logits = w * (softmax - onehot), built in the logits buffer."""
    logits_CV = h_CE @ W_VE.T if b_V is None else torch.addmm(b_V, h_CE, W_VE.T)
    if exclude_X.numel():
        logits_CV.index_fill_(1, exclude_X, float("-inf"))
    lse_C = torch.logsumexp(logits_CV, dim=1)
    ce_C = lse_C - logits_CV.gather(1, targets_C[:, None]).squeeze(1)
    if not need_grad:
        return ce_C, None
    grad_CV = logits_CV.sub_(lse_C[:, None]).exp_()  # softmax, in place
    grad_CV.scatter_add_(1, targets_C[:, None], torch.full_like(lse_C[:, None], -1.0))
    return ce_C, grad_CV.mul_(weights_C.to(grad_CV.dtype)[:, None])


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an input is float64 (so float64 tests compare exactly)."""
    return torch.promote_types(torch.float32, torch.promote_types(hidden.dtype, weight.dtype))


def _cast(grad: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)
