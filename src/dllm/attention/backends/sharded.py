"""Attention of a rank's rows against the keys it holds, under the GLOBAL mask (context parallelism).

Context and block parallelism (dllm.parallel.context) give each rank some rows of the model input
and, per layer, a key set: keys gathered from the other ranks plus its own. This module computes that
attention without knowing how the keys got there (no torch.distributed here): query q is global row
`q_rows[q]`, key kv is global row `kv_rows[kv]`, and the description's mask function is evaluated
at those global indices (`masks.index_mapped`), so documents, key padding, windows and the
block-diffusion pattern work across shard boundaries unchanged.

- CPU (and the reference): SDPA with a dense bool mask [B, 1, Lq, Lk] of the index-mapped function.
- CUDA: FlexAttention with a BlockMask built from the same function (keys are grouped by owner, so a
  rank's key order is a few sorted runs and the tiles stay sparse). UNTESTED on a GPU so far: on CPU
  only its forward can be checked against the dense path (FlexAttention has no CPU backward).
- Both are built once per description, mapping and shape through the description's `cache`, so all
  layers of one forward share them.

Shapes: B batch, H query heads, K key/value heads, Q local query rows, S keys held, D head width.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Literal

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from dllm.attention.backends.flex import FlexBackend
from dllm.attention.masks import AttentionMask, dense_mask, depends_on_batch, index_mapped, mask_mod

Kernel = Literal["dense", "flex"]


def sharded_attention(
    q_BHQD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    mask: AttentionMask,
    q_rows: torch.Tensor,
    kv_rows: torch.Tensor,
    num_rows: int,
    map_key: Hashable,
    kernel: Kernel = "dense",
    flex: FlexBackend | None = None,
) -> torch.Tensor:
    """out [B, H, Q, D] of local queries (global rows `q_rows` [Q]) over held keys (global rows
    `kv_rows` [S]); `num_rows` is the global key length the description is laid out on (L, or 2L
    for block diffusion). `map_key` names the mapping in the mask cache (e.g. the shard plan)."""
    if mask.query_offset or mask.query_offset_B is not None:
        raise ValueError("sharded attention evaluates global row indices: a mask with query_offset is not supported")
    assert q_rows.numel() == q_BHQD.shape[2] and kv_rows.numel() == k_BKSD.shape[2], "rows and tensors disagree"
    gqa = k_BKSD.shape[1] != q_BHQD.shape[1]
    if mask.kind == "bidirectional" and mask.is_plain:  # every pair allowed, whatever the row order
        return F.scaled_dot_product_attention(q_BHQD, k_BKSD, v_BKSD, enable_gqa=gqa)
    B, Q, S, device = q_BHQD.shape[0], q_BHQD.shape[2], k_BKSD.shape[2], q_BHQD.device

    def mod():
        return index_mapped(mask_mod(mask, num_rows), q_rows.to(device), kv_rows.to(device))

    if kernel == "flex":
        mask_batch = B if depends_on_batch(mask) else None
        key = ("sharded-flex", map_key, mask_batch, Q, S, device)

        def build() -> BlockMask:
            return create_block_mask(mod(), mask_batch, None, Q, S, device=device)

        block_mask = mask.cache.memo(key, build)
        return (flex or FlexBackend()).run(q_BHQD, k_BKSD, v_BKSD, block_mask)
    dense = mask.cache.memo(("sharded-sdpa", map_key, B, Q, S, device), lambda: dense_mask(mod(), B, Q, S, device))
    return F.scaled_dot_product_attention(q_BHQD, k_BKSD, v_BKSD, attn_mask=dense, enable_gqa=gqa)


# --------------------------------------------------------------------------------------------------
# partial attention over one key shard, merged by log-sum-exp (the ring transport of context parallelism)


def shard_mask(
    mask: AttentionMask, q_rows: torch.Tensor, kv_rows: torch.Tensor, num_rows: int, batch: int
) -> torch.Tensor | None:
    """The dense bool tile [B, 1, Q, S] of the global mask at (query rows `q_rows`, key rows `kv_rows`);
    None when every pair is allowed (plain bidirectional). Not memoised: the ring builds each step's
    tile inside the step's checkpoint (again in the backward), so no more than one step's tile lives
    at a time, instead of a Q x all-keys mask in the cache."""
    if mask.query_offset or mask.query_offset_B is not None:
        raise ValueError("sharded attention evaluates global row indices: a mask with query_offset is not supported")
    if mask.kind == "bidirectional" and mask.is_plain:
        return None
    device = q_rows.device
    mod = index_mapped(mask_mod(mask, num_rows), q_rows, kv_rows.to(device))
    return dense_mask(mod, batch, q_rows.numel(), kv_rows.numel(), device)


def partial_attention(
    q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask_B1QS: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of the queries over ONE key shard: (out [B, H, Q, D], lse [B, H, Q]) in fp32
    (fp64 for fp64 inputs), out normalised over this shard's allowed keys and lse = log sum_k exp(score)
    over them (SDPA's default scale 1/sqrt(D); GQA when K < H). A query row with no allowed key in the shard gets out 0
    and lse -inf, with finite gradients (it contributes nothing to `merge_partials`). Plain torch ops,
    differentiable; the score tile is [B, H, Q, S] for this shard only."""
    B, H, Q, D = q_BHQD.shape
    K, acc = k_BKSD.shape[1], torch.promote_types(q_BHQD.dtype, torch.float32)
    q = q_BHQD.reshape(B, K, H // K, Q, D)
    scores = torch.matmul(q, k_BKSD.unsqueeze(2).transpose(-1, -2)).to(acc) * D**-0.5  # [B, K, G, Q, S]
    if mask_B1QS is not None:
        scores = scores.masked_fill(~mask_B1QS.unsqueeze(2), float("-inf"))
    top = scores.amax(-1, keepdim=True).detach()  # the max cancels in out and in d lse / d score: no gradient
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    p = torch.exp(scores - top)  # masked keys: exp(-inf) = 0
    total = p.sum(-1, keepdim=True)
    live = total > 0
    safe = torch.where(live, total, torch.ones_like(total))  # double where: no inf/NaN in any gradient
    out = torch.matmul(p.to(v_BKSD.dtype), v_BKSD.unsqueeze(2)).to(acc) / safe
    lse = torch.where(live, top + torch.log(safe), torch.full_like(top, float("-inf")))
    return out.reshape(B, H, Q, D), lse.reshape(B, H, Q)


def merge_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Exact softmax attention over the union of the shards from their partials (`partial_attention`):
    out = sum_s exp(lse_s - lse) out_s with lse = logsumexp_s lse_s. A query row masked in every shard
    gets 0 (what SDPA returns for a fully masked row), with finite gradients. [B, H, Q, D], the partials' dtype."""
    lse = torch.stack(lses)  # [N, B, H, Q]
    top = lse.amax(0).detach()
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    weights = torch.exp(lse - top)  # 0 for a shard where the row has no key
    total = weights.sum(0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = sum(w.unsqueeze(-1) * o for w, o in zip(weights.unbind(0), outs, strict=True))
    return out / safe.unsqueeze(-1)
