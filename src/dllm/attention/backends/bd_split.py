"""BD3LM's block-diffusion attention on CPU as two exact parts merged with log-sum-exp statistics.

The 2L layout [x_t ; x_0] allows L*L + L*B of 4*L*L pairs (masks.block_diffusion). Every allowed key
of a query lies in one of two disjoint sets:

- part A, clean keys: a clean query sees x_0 up to its own block, a noisy query x_0 strictly before
  its block. Over block-aligned query chunks [s, e) both halves' queries need only x_0[0:e], a
  contiguous slice: one SDPA call per chunk scores 2*Lc*e pairs, L*L*(S+1)/S in all for S chunks.
- part B, noisy keys: a noisy query sees x_t of its own block only. The L noisy rows reshaped to
  [B * L/B blocks, H, B, D] make that one batched call of L*B pairs.

The noisy rows' two partial softmaxes are merged exactly with their log-sum-exps (the flash-attention
/ ring-attention identity); the backward runs each part's flash backward with the merged output and
log-sum-exp, which yields exactly the gradient of the merged softmax. At S = 8 this scores 1.16*L*L
pairs against 1.375*L*L for the one-call-per-chunk plan (blockwise.chunk_plan) and 4*L*L for the
dense mask, and every key slice is a view (no gathered copies of k and v).

Both parts use ATen's CPU flash-attention kernel directly (`_scaled_dot_product_flash_attention_for_cpu`
and its backward), which returns the log-sum-exp the public SDPA hides. Masks come from the shared
mask function at global indices, so documents, key padding and windows are exact by construction;
rows with no allowed key at all output 0, as the CPU flash kernel does.

Shapes: B batch, H query heads, K key/value heads, L sequence length (2L layout), D head width,
N number of blocks, Q / C rows of one call's queries / keys.
"""

from __future__ import annotations

import copy
import math

import torch

from dllm.attention.masks import AttentionMask, MaskMod, depends_on_batch, layout_length, mask_mod

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
Span = tuple[int, int]


def supports(q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, mask: AttentionMask) -> bool:
    """Whether this path computes the call: CPU, a block-diffusion mask, queries = all 2L or x_t's L rows."""
    if mask.kind != "block_diffusion" or q_BHQD.device.type != "cpu" or k_BKSD.device.type != "cpu":
        return False
    if q_BHQD.dtype not in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        return False
    kv_len, q_len = k_BKSD.shape[2], q_BHQD.shape[2]
    return kv_len % 2 == 0 and q_len in (kv_len, kv_len // 2)


def split_attention(
    q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask, num_chunks: int
) -> torch.Tensor:
    """q [B, H, 2L or L, D], k/v [B, K, 2L, D] -> [B, H, 2L or L, D]; equal to the dense-mask SDPA."""
    seq_len = layout_length(mask, k_BKSD.shape[2])
    assert seq_len is not None and mask.block_size is not None
    plan = Plan.of(mask, q_BHQD, seq_len, num_chunks)
    return _SplitAttention.apply(q_BHQD, k_BKSD, v_BKSD, plan)


class Plan:
    """The calls of one (mask, shape, dtype): chunk spans, additive masks and which rows have keys."""

    def __init__(self, mask: AttentionMask, batch: int, seq_len: int, q_len: int, num_chunks: int, dtype, device):
        from dllm.attention.backends.blockwise import chunk_spans

        assert mask.block_size is not None
        self.seq_len, self.block_size, self.noisy_only = seq_len, mask.block_size, q_len == seq_len
        self.spans: list[Span] = chunk_spans(seq_len, mask.block_size, num_chunks)
        mod = mask_mod(mask, 2 * seq_len)
        mb = batch if depends_on_batch(mask) else 1
        L, bs = seq_len, mask.block_size
        self.a_masks: list[torch.Tensor] = []  # additive [mb, 1, Q, e] per chunk
        self.a_has_key: list[torch.Tensor] = []  # bool [mb, 1, Q] per chunk
        for s, e in self.spans:
            rows = [torch.arange(s, e, device=device)]
            if not self.noisy_only:
                rows.append(torch.arange(L + s, L + e, device=device))
            allowed = _evaluate(mod, mb, torch.cat(rows), torch.arange(L, L + e, device=device))
            self.a_masks.append(_additive(allowed, dtype))
            self.a_has_key.append(allowed.any(-1))
        n = L // bs
        idx = torch.arange(L, device=device).view(n, bs)
        allowed_b = _evaluate(mod, mb, idx[:, :, None], idx[:, None, :], blocked=True)  # [mb, N, bs, bs]
        self.b_mask = _additive(allowed_b.expand(batch, n, bs, bs).reshape(batch * n, 1, bs, bs), dtype)
        self.b_has_key = allowed_b.any(-1).expand(batch, n, bs).reshape(batch, 1, L)  # [B, 1, L]

    def noisy_rows(self) -> Plan:
        """The plan of a call whose queries are x_t's rows only (a last layer): part A's masks are the
        first rows of each chunk's (views, nothing evaluated again); part B is the same."""
        plan = copy.copy(self)
        plan.noisy_only = True
        plan.a_masks = [m[:, :, : e - s] for m, (s, e) in zip(self.a_masks, self.spans, strict=True)]
        plan.a_has_key = [h[:, :, : e - s] for h, (s, e) in zip(self.a_has_key, self.spans, strict=True)]
        return plan

    @staticmethod
    def of(mask: AttentionMask, q: torch.Tensor, seq_len: int, num_chunks: int) -> Plan:
        key = ("bd_split", q.shape[0], seq_len, q.shape[2], num_chunks, q.dtype, q.device)
        if q.shape[2] == seq_len:  # x_t's queries only: a view of the full plan when the step built one
            full = mask.memoized(("bd_split", q.shape[0], seq_len, 2 * seq_len, num_chunks, q.dtype, q.device))
            if full is not None:
                return mask.memo(key, full.noisy_rows)
        return mask.memo(key, lambda: Plan(mask, q.shape[0], seq_len, q.shape[2], num_chunks, q.dtype, q.device))

    def query_rows(self, x_BHQD: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """Part A's query rows of chunk [s, e): x_t[s:e] then (unless noisy-only) x_0[s:e]. The rows are
        gathered row-major ([B, Q, H, D] memory, like `_rows_major`), so each half is one block copy."""
        if self.noisy_only:
            return x_BHQD[:, :, s:e]
        L, x_BQHD = self.seq_len, x_BHQD.transpose(1, 2)
        return torch.cat([x_BQHD[:, s:e], x_BQHD[:, L + s : L + e]], dim=1).transpose(1, 2)

    def put_rows(self, dst_BHQD: torch.Tensor, rows_BHQD: torch.Tensor, s: int, e: int) -> None:
        n = e - s
        dst_BHQD[:, :, s:e] = rows_BHQD[:, :, :n]
        if not self.noisy_only:
            dst_BHQD[:, :, self.seq_len + s : self.seq_len + e] = rows_BHQD[:, :, n:]

    def blocks(self, x_BHLD: torch.Tensor) -> torch.Tensor:
        """x_t's rows [B, H, L, D] -> [B*N, H, bs, D] (one batch entry per block). On row-major memory
        ([B, L, H, D], the model's and the kernel's layout) this is a view for L rows and one block
        copy per batch entry for 2L."""
        B, H, _, D = x_BHLD.shape
        n, bs = self.seq_len // self.block_size, self.block_size
        return x_BHLD[:, :, : self.seq_len].transpose(1, 2).reshape(B * n, bs, H, D).transpose(1, 2)

    def unblocks(self, x_GHbD: torch.Tensor, batch: int) -> torch.Tensor:
        """Inverse of `blocks`: [B*N, H, bs, D] -> [B, H, N, bs, D] (a view of the kernel's outputs)."""
        _, H, bs, D = x_GHbD.shape
        return x_GHbD.transpose(1, 2).reshape(batch, self.seq_len // bs, bs, H, D).permute(0, 3, 1, 2, 4)

    def rows5(self, x_BHSD: torch.Tensor) -> torch.Tensor:
        """x_t's rows of [B, H, S, D] as a [B, H, N, bs, D] view (to meet `unblocks` without copies)."""
        B, H, _, D = x_BHSD.shape
        return x_BHSD[:, :, : self.seq_len].view(B, H, self.seq_len // self.block_size, self.block_size, D)


def _evaluate(mod: MaskMod, mb: int, q_idx: torch.Tensor, kv_idx: torch.Tensor, blocked: bool = False) -> torch.Tensor:
    b = torch.arange(mb, device=q_idx.device)
    h = torch.zeros((), dtype=torch.long, device=q_idx.device)
    if blocked:  # q [N, bs, 1], kv [N, 1, bs] -> [mb, N, bs, bs]
        return mod(b[:, None, None, None], h, q_idx[None], kv_idx[None])
    return mod(b[:, None, None, None], h, q_idx[None, None, :, None], kv_idx[None, None, None, :]).expand(
        mb, 1, q_idx.numel(), kv_idx.numel()
    )


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.full((), float("-inf"), dtype=dtype, device=allowed.device))


def _rows_major(B: int, H: int, Q: int, D: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty [B, H, Q, D] laid out as [B, Q, H, D], the layout of the kernel's own outputs and of the
    model's projections: row copies in and out are contiguous, and the model's transpose-and-reshape of
    the output (and of q/k/v's gradients) is a view instead of a copy."""
    return torch.empty(B, Q, H, D, dtype=dtype, device=device).transpose(1, 2)


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """x itself when the kernel can read it in place: any strides, but each row's D values adjacent."""
    return x if x.stride(-1) == 1 and 0 not in x.stride()[:-1] else x.contiguous()


class _SplitAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHQD, k_BKSD, v_BKSD, plan: Plan):  # type: ignore[override]
        q_BHQD, k_BKSD, v_BKSD = _dense_rows(q_BHQD), _dense_rows(k_BKSD), _dense_rows(v_BKSD)
        B, H, Q, D = q_BHQD.shape
        L, scale = plan.seq_len, 1.0 / math.sqrt(D)
        k0, v0 = k_BKSD[:, :, L:], v_BKSD[:, :, L:]  # x_0's keys: part A
        acc = torch.promote_types(q_BHQD.dtype, torch.float32)  # the kernel's log-sum-exp dtype
        out = _rows_major(B, H, Q, D, acc, q_BHQD.device)
        lse = torch.empty(B, H, Q, dtype=acc, device=q_BHQD.device)
        for (s, e), m, has in zip(plan.spans, plan.a_masks, plan.a_has_key, strict=True):
            o_c, lse_c = _flash(plan.query_rows(q_BHQD, s, e), k0[:, :, :e], v0[:, :, :e], attn_mask=m, scale=scale)
            lse_c = lse_c.masked_fill(~has, float("-inf"))  # the kernel reports 0 for rows without keys
            plan.put_rows(out, o_c, s, e)
            plan.put_rows(lse[..., None], lse_c[..., None], s, e)
        # part B: noisy queries against their own block of x_t, then the exact merge on x_t's rows
        o_b, lse_b = _flash(
            plan.blocks(q_BHQD), plan.blocks(k_BKSD), plan.blocks(v_BKSD), attn_mask=plan.b_mask, scale=scale
        )
        n, bs = L // plan.block_size, plan.block_size
        lse_b = plan.unblocks(lse_b[..., None], B).reshape(B, H, L).masked_fill(~plan.b_has_key, float("-inf"))
        lse_a = lse[:, :, :L]
        top = torch.maximum(lse_a, lse_b)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # no key at all: out 0, lse 0
        w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
        total = w_a + w_b
        safe = torch.where(total > 0, total, torch.ones_like(total))
        o_a = plan.rows5(out)  # in place on x_t's rows: out = (w_a * o_a + w_b * o_b) / total
        o_a.mul_((w_a / safe).view(B, H, n, bs, 1)).addcmul_(plan.unblocks(o_b, B), (w_b / safe).view(B, H, n, bs, 1))
        lse_a.copy_(top + torch.log(safe))
        if not plan.noisy_only:
            lse_0 = lse[:, :, L:]
            lse_0.masked_fill_(~torch.isfinite(lse_0), 0.0)
        out = out.to(q_BHQD.dtype)
        ctx.save_for_backward(q_BHQD, k_BKSD, v_BKSD, out, lse)
        ctx.plan, ctx.scale = plan, scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BHQD):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan: Plan = ctx.plan
        L, B = plan.seq_len, q.shape[0]
        grad = _dense_rows(grad_BHQD)  # any strides the kernel reads (an expanded gradient is made dense)
        acc = lse.dtype
        dq = _rows_major(*q.shape, acc, q.device)  # every row written by part A
        dk0 = dv0 = None  # x_0's key gradients: summed over the chunks, from the last (all keys) down
        k0, v0 = k[:, :, L:], v[:, :, L:]
        for (s, e), m in reversed(list(zip(plan.spans, plan.a_masks, strict=True))):
            g_c, q_c, o_c = (plan.query_rows(t, s, e) for t in (grad, q, out))
            lse_c = plan.query_rows(lse[..., None], s, e)[..., 0].contiguous()
            dq_c, dk_c, dv_c = _flash_backward(
                g_c, q_c, k0[:, :, :e], v0[:, :, :e], o_c, lse_c, 0.0, False, attn_mask=m, scale=ctx.scale
            )
            plan.put_rows(dq, dq_c, s, e)
            if dk0 is None or dv0 is None:
                assert e == L  # the last chunk ends at L
                dk0, dv0 = dk_c.to(acc), dv_c.to(acc)  # the kernel's fresh outputs: summed into in place
            else:
                dk0[:, :, :e] += dk_c
                dv0[:, :, :e] += dv_c
        assert dk0 is not None and dv0 is not None
        lse_blocks = plan.blocks(lse[:, :, :L, None])[..., 0].contiguous()
        dq_b, dk_b, dv_b = _flash_backward(
            plan.blocks(grad), plan.blocks(q), plan.blocks(k), plan.blocks(v), plan.blocks(out), lse_blocks,
            0.0, False, attn_mask=plan.b_mask, scale=ctx.scale,
        )  # fmt: skip
        plan.rows5(dq).add_(plan.unblocks(dq_b, B))
        dk, dv = _rows_major(*k.shape, acc, k.device), _rows_major(*v.shape, acc, v.device)
        plan.rows5(dk).copy_(plan.unblocks(dk_b, B))  # x_t's keys: only their own block's queries
        plan.rows5(dv).copy_(plan.unblocks(dv_b, B))
        dk[:, :, L:] = dk0
        dv[:, :, L:] = dv0
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
