"""The ring transport's arithmetic, in one process (no torch.distributed): partial attention over a
split of the keys, merged by log-sum-exp, equals SDPA over all keys, in the forward and the backward,
including query rows fully masked in some shards and in every shard (finite, 0 like SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.backends.sharded import merge_partials, partial_attention

B, H, K, Q, S, D = 2, 4, 2, 7, 12, 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(B, K, S, D, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(B, K, S, D, generator=g, dtype=torch.float64).requires_grad_()
    mask = torch.rand(B, 1, Q, S, generator=g) < 0.5
    mask[:, :, 0, :5] = False  # row 0: nothing in the first shard
    mask[0, :, 1, :] = False  # row 1 of batch 0: nothing anywhere (padding-like)
    mask[1, :, 2, 5:] = False  # row 2 of batch 1: only the first shard
    return q, k, v, mask


@pytest.mark.parametrize("splits", [[12], [5, 7], [5, 3, 4], [1, 4, 3, 4]])
@pytest.mark.parametrize("masked", [True, False])
def test_merged_partials_equal_full_attention(splits: list[int], masked: bool):
    q, k, v, mask = _inputs(0)
    mask = mask if masked else None
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    g = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)

    parts = []
    for ks, vs, ms in zip(
        k.split(splits, 2), v.split(splits, 2), mask.split(splits, 3) if masked else [None] * len(splits), strict=True
    ):
        parts.append(partial_attention(q, ks, vs, ms))
    out = merge_partials([p[0] for p in parts], [p[1] for p in parts])
    grads = torch.autograd.grad(out, (q, k, v), g)

    assert _rel(out, ref) <= 1e-12
    for a, b in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(a).all()
        assert _rel(a, b) <= 1e-12
    if masked:
        assert (out[0, :, 1] == 0).all() and (ref[0, :, 1] == 0).all()  # fully masked row: 0, like SDPA


def test_fully_masked_shard_gives_minus_inf_lse_and_finite_gradients():
    q, k, v, mask = _inputs(1)
    mask[:] = False
    mask[:, :, 3, 2] = True  # one allowed pair per batch row
    out, lse = partial_attention(q, k, v, mask)
    assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3]).all()
    assert (out[:, :, :3] == 0).all()
    torch.testing.assert_close(out[:, :, 3], v[:, :, 2].repeat_interleave(H // K, 1))  # softmax over one key
    grads = torch.autograd.grad((out.sum() + lse[:, :, 3].sum()), (q, k, v))
    assert all(torch.isfinite(t).all() for t in grads)


def test_lse_is_the_log_sum_exp_of_the_allowed_scores():
    q, k, v, mask = _inputs(2)
    _, lse = partial_attention(q, k, v, mask)
    scores = torch.einsum("bkgqd,bksd->bkgqs", q.view(B, K, H // K, Q, D), k) / D**0.5
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf")).reshape(B, H, Q, S)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1))


def test_transport_is_configurable_and_checked():
    from dllm.config.training import ContextParallelConfig
    from dllm.parallel.context import build_plan
    from dllm.parallel.context_attention import ContextParallelAttention

    assert ContextParallelConfig(mode="csbp", cp_size=2, bp_size=2, transport="ring").transport == "ring"
    assert ContextParallelConfig().transport == "collective"  # the default stays the all-gather
    plan = build_plan("bp", 32, 4, bp=2)  # exchanges nothing: no process group needed
    assert ContextParallelAttention(None, plan, None, transport="ring").transport == "ring"
    with pytest.raises(ValueError, match="transport"):
        ContextParallelAttention(None, plan, None, transport="allgather")
