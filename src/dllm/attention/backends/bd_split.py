"""BD3LM's block-diffusion attention on CPU as two exact parts merged with log-sum-exp statistics.

The 2L layout [x_t ; x_0] allows L*L + L*B of 4*L*L pairs (masks.block_diffusion). Every allowed key
of a query lies in one of two disjoint sets:

- part A, clean keys: a clean query sees x_0 up to its own block, a noisy query x_0 strictly before
  its block. Over block-aligned query chunks [s, e) both halves' queries need only x_0[0:e], a
  contiguous slice: one SDPA call per chunk scores 2*Lc*e pairs, L*L*(S+1)/S in all for S chunks.
- part B, noisy keys: a noisy query sees x_t of its own block only. The L noisy rows reshaped to
  [B * L/B blocks, H, B, D] make that one batched call of L*B pairs.

With V noisy copies sharing one clean stream (`AttentionMask.views`, the layout [x_t^1 ; ... ; x_t^V ;
x_0] of Fast-dLLM v2's two views) the same two parts hold: part A's calls take every copy's rows of
the chunk (and x_0's) against x_0's keys, part B's batched call every copy's blocks.

The noisy rows' two partial softmaxes are merged exactly with their log-sum-exps (the flash-attention
/ ring-attention identity); the backward runs each part's flash backward with the merged output and
log-sum-exp, which yields exactly the gradient of the merged softmax. At S = 8 this scores 1.16*L*L
pairs against 1.375*L*L for the one-call-per-chunk plan (blockwise.chunk_plan) and 4*L*L for the
dense mask, and every key slice is a view (no gathered copies of k and v).

Both parts use ATen's CPU flash-attention kernel directly (`_scaled_dot_product_flash_attention_for_cpu`
and its backward), which returns the log-sum-exp the public SDPA hides. Masks come from the shared
mask function at global indices, so documents, key padding and windows are exact by construction;
rows with no allowed key at all output 0, as the CPU flash kernel does.

Two measured refinements (bench/objectives.py, demo model, L = 512):
- a part A call over both halves stacks the G query heads that share a key/value head along its rows
  ([B, K, G * 2 * Lc, D]): each key is read once for G heads, and 256 rows instead of 128 move the
  kernel to its larger query tile (64 rows instead of 32); ~3.5% off a full layer's attention;
- keys that no row of a chunk may see (other documents, outside a window; for x_t's rows alone, as
  in a last layer, their own block's x_0) are left out of its call: the key slice runs from the first
  to the last key some row sees. The demo corpus packs ~20-token documents, so part A scores
  ~0.37 * L * L pairs instead of 1.125 * L * L: attention fell from ~280 to ~140 ms of a training step.

A plan (chunk spans, additive masks, rows without keys) is built once per mask description and shape
(`AttentionMask.cache`) and shared by all layers of the forward; the last layer's x_t-only plan is a
view of it. Each step builds its own (~5 ms at L = 512, ~1% of a demo step).

Shapes: B batch, H query heads, K key/value heads, L sequence length (2L layout), D head width,
N number of blocks, Q / C rows of one call's queries / keys.
"""

from __future__ import annotations

import copy
import math

import torch

from dllm.attention.backends.spans import Span, chunk_spans
from dllm.attention.masks import AttentionMask, MaskMod, depends_on_batch, layout_length, mask_mod

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def supports(q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, mask: AttentionMask) -> bool:
    """Whether this path computes the call: CPU, a block-diffusion mask, queries = all 2L or x_t's L rows."""
    if mask.kind != "block_diffusion" or q_BHQD.device.type != "cpu" or k_BKSD.device.type != "cpu":
        return False
    if q_BHQD.dtype not in (torch.float32, torch.bfloat16, torch.float64, torch.float16):
        return False
    kv_len, q_len, parts = k_BKSD.shape[2], q_BHQD.shape[2], mask.views + 1
    return kv_len % parts == 0 and q_len in (kv_len, kv_len // parts * mask.views)


@torch.compiler.disable  # data-dependent plans (key spans, rows without keys): eager inside compiled blocks
def split_attention(
    q_BHQD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, mask: AttentionMask, num_chunks: int
) -> torch.Tensor:
    """q [B, H, 2L or L, D], k/v [B, K, 2L, D] -> [B, H, 2L or L, D]; equal to the dense-mask SDPA. With
    `mask.views` V noisy copies: k/v [B, K, (V + 1) L, D], q all those rows or the V * L noisy ones."""
    seq_len = layout_length(mask, k_BKSD.shape[2])
    assert seq_len is not None and mask.block_size is not None
    plan = Plan.of(mask, q_BHQD, k_BKSD, seq_len, num_chunks)
    return _SplitAttention.apply(q_BHQD, k_BKSD, v_BKSD, plan)


class Plan:
    """The calls of one (mask, shape, dtype): chunk spans, additive masks and which rows have keys."""

    def __init__(
        self, mask: AttentionMask, batch: int, seq_len: int, q_len: int, num_chunks: int, group: int, dtype, device
    ):
        assert mask.block_size is not None
        V = mask.views  # noisy copies before x_0 (one in the 2L layout)
        self.seq_len, self.views, self.noisy_len, self.block_size = seq_len, V, V * seq_len, mask.block_size
        self.noisy_only = q_len == self.noisy_len
        self.group = 1 if self.noisy_only else group
        self.spans: list[Span] = chunk_spans(seq_len, mask.block_size, num_chunks)
        mod = mask_mod(mask, (V + 1) * seq_len)
        mb = batch if depends_on_batch(mask) else 1
        L, N, bs = seq_len, self.noisy_len, mask.block_size
        self.a_masks: list[torch.Tensor] = []  # additive [mb, 1, Q, hi - lo] per chunk
        self.a_has_key: list[torch.Tensor] = []  # bool [mb, 1, Q] per chunk
        self.key_ranges: list[Span] = []  # per chunk: the x_0 keys [lo, hi) some row of the call may see
        for s, e in self.spans:
            rows = [torch.arange(v * L + s, v * L + e, device=device) for v in range(V)]  # each copy's x_t[s:e]
            if not self.noisy_only:
                rows.append(torch.arange(N + s, N + e, device=device))
            allowed = _evaluate(mod, mb, torch.cat(rows), torch.arange(N, N + e, device=device))
            lo, hi = _seen_keys(allowed)  # other documents, outside a window, x_t's own block: left out
            self.key_ranges.append((lo, hi))
            self.a_masks.append(_additive(allowed[..., lo:hi], dtype))
            self.a_has_key.append(allowed.any(-1))
        # the calls' rows are `group` query heads' rows stacked (see `query_rows`): the masks repeat per head
        G = self.group
        self.call_masks = [m.repeat(1, 1, G, 1) for m in self.a_masks] if G > 1 else self.a_masks
        self.call_no_key = [_missing(h, G) for h in self.a_has_key]
        n = N // bs  # the blocks of every noisy copy, in row order
        idx = torch.arange(N, device=device).view(n, bs)
        allowed_b = _evaluate(mod, mb, idx[:, :, None], idx[:, None, :], blocked=True)  # [mb, n, bs, bs]
        self.b_mask = _additive(allowed_b.expand(batch, n, bs, bs).reshape(batch * n, 1, bs, bs), dtype)
        self.b_no_key = _missing(allowed_b.any(-1).expand(batch, n, bs).reshape(batch, 1, N), 1)  # [B, 1, V L]

    def noisy_rows(self) -> Plan:
        """The plan of a call whose queries are x_t's rows only (a last layer): part A's masks are views
        of the first rows of each chunk's, narrowed to the keys those rows see (the mask function is not
        evaluated again); part B is the same."""
        plan = copy.copy(self)
        plan.noisy_only = True
        plan.a_masks, plan.key_ranges = [], []
        V = self.views
        for m, (s, e), (lo, _) in zip(self.a_masks, self.spans, self.key_ranges, strict=True):
            m = m[:, :, : V * (e - s)]  # x_t's rows; they see fewer keys (not their own block's x_0)
            a, b = _seen_keys(m == 0)
            plan.a_masks.append(m[..., a:b])
            plan.key_ranges.append((lo + a, lo + b))
        plan.a_has_key = [h[:, :, : V * (e - s)] for h, (s, e) in zip(self.a_has_key, self.spans, strict=True)]
        plan.call_masks, plan.call_no_key, plan.group = plan.a_masks, [_missing(h, 1) for h in plan.a_has_key], 1
        return plan

    @staticmethod
    def of(mask: AttentionMask, q: torch.Tensor, k: torch.Tensor, seq_len: int, num_chunks: int) -> Plan:
        """The plan of this call, built once per mask description and shape (`mask.cache`): every
        layer of one forward gets the same description."""
        group = q.shape[1] // k.shape[1]  # query heads per key/value head
        key = ("bd_split", q.shape[0], seq_len, q.shape[2], num_chunks, group, q.dtype, q.device)
        if q.shape[2] == mask.views * seq_len:  # x_t's queries only: a view of the full plan when the step built one
            full = ("bd_split", q.shape[0], seq_len, k.shape[2], num_chunks, group, q.dtype, q.device)
            if (built := mask.cache.built(full)) is not None:
                return mask.cache.memo(key, built.noisy_rows)
        build = lambda: Plan(mask, q.shape[0], seq_len, q.shape[2], num_chunks, group, q.dtype, q.device)  # noqa: E731
        return mask.cache.memo(key, build)

    def query_rows(self, x_BHQD: torch.Tensor, s: int, e: int) -> torch.Tensor:
        """Part A's call rows of chunk [s, e): x_t[s:e] (of each noisy copy) then (unless noisy-only)
        x_0[s:e], as [B, H / G, G * Q, D]: the G query heads that share a key/value head are stacked along
        the rows (G = `group`), so one call has G times the rows and reads each key once for all G heads.
        The CPU kernel tiles queries 32 rows at a time below 192 rows and 64 above: 2 * 64 rows at S = 8
        run in the small tiles unless heads are stacked. Noisy-only calls (G = 1) of one copy are views."""
        if self.noisy_only and self.views == 1:
            return x_BHQD[:, :, s:e]
        B, H, _, D = x_BHQD.shape
        G, n, parts = self.group, e - s, self._parts()
        rows = torch.empty(B, H // G, G, parts, n, D, dtype=x_BHQD.dtype, device=x_BHQD.device)
        rows.copy_(self._halves(x_BHQD)[..., s:e, :])  # every part's rows in one copy
        return rows.view(B, H // G, G * parts * n, D)

    def _parts(self) -> int:
        """Row blocks of L in a call's queries: the noisy copies, and x_0 unless noisy-only."""
        return self.views + (0 if self.noisy_only else 1)

    def _halves(self, x_BHQD: torch.Tensor) -> torch.Tensor:
        """[B, H, P L, D] as a [B, H / G, G, P (the x_t copies, then x_0 unless noisy-only), L, D] view."""
        B, H, _, D = x_BHQD.shape
        return x_BHQD.view(B, H // self.group, self.group, self._parts(), self.seq_len, D)

    def put_rows(self, dst_BHQD: torch.Tensor, rows: torch.Tensor, s: int, e: int) -> None:
        """Inverse of `query_rows`: write a call's rows back to the chunk's rows of dst [B, H, Q, D]."""
        n = e - s
        if self.noisy_only and self.views == 1:
            dst_BHQD[:, :, s:e] = rows
            return
        B, H, _, D = dst_BHQD.shape
        self._halves(dst_BHQD)[..., s:e, :] = rows.view(B, H // self.group, self.group, self._parts(), n, D)

    def blocks(self, x_BHLD: torch.Tensor) -> torch.Tensor:
        """The noisy rows (every copy's) [B, H, V L, D] -> [B*N, H, bs, D] (one batch entry per block). On
        row-major memory ([B, L, H, D], the model's and the kernel's layout) this is a view for the noisy
        rows alone and one block copy per batch entry when x_0's rows follow."""
        B, H, _, D = x_BHLD.shape
        n, bs = self.noisy_len // self.block_size, self.block_size
        return x_BHLD[:, :, : self.noisy_len].transpose(1, 2).reshape(B * n, bs, H, D).transpose(1, 2)

    def unblocks(self, x_GHbD: torch.Tensor, batch: int) -> torch.Tensor:
        """Inverse of `blocks`: [B*N, H, bs, D] -> [B, H, N, bs, D] (a view of the kernel's outputs)."""
        _, H, bs, D = x_GHbD.shape
        return x_GHbD.transpose(1, 2).reshape(batch, self.noisy_len // bs, bs, H, D).permute(0, 3, 1, 2, 4)

    def rows5(self, x_BHSD: torch.Tensor) -> torch.Tensor:
        """The noisy rows of [B, H, S, D] as a [B, H, N, bs, D] view (to meet `unblocks` without copies)."""
        B, H, _, D = x_BHSD.shape
        return x_BHSD[:, :, : self.noisy_len].view(B, H, self.noisy_len // self.block_size, self.block_size, D)


def _missing(has_key: torch.Tensor, group: int) -> torch.Tensor | None:
    """Rows of a call without any key ([mb, 1, group * Q], rows stacked per head), or None if none."""
    return None if bool(has_key.all()) else (~has_key).repeat(1, 1, group)


def _neginf_to_zero(x: torch.Tensor) -> torch.Tensor:
    """-inf -> 0 in place (a row without keys); NaN and +inf stay visible."""
    return x.nan_to_num_(nan=float("nan"), posinf=float("inf"), neginf=0.0)


def _seen_keys(allowed: torch.Tensor) -> Span:
    """The key columns [lo, hi) of allowed [..., Q, C] that some row may see (one column when none is)."""
    seen = allowed.reshape(-1, allowed.shape[-1]).any(0).nonzero()
    return (int(seen[0]), int(seen[-1]) + 1) if seen.numel() else (0, 1)


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
        N, scale = plan.noisy_len, 1.0 / math.sqrt(D)
        k0, v0 = k_BKSD[:, :, N:], v_BKSD[:, :, N:]  # x_0's keys: part A
        acc = torch.promote_types(q_BHQD.dtype, torch.float32)  # the kernel's log-sum-exp dtype
        out = _rows_major(B, H, Q, D, acc, q_BHQD.device)
        lse = torch.empty(B, H, Q, dtype=acc, device=q_BHQD.device)
        q_calls = []  # each chunk's gathered query rows, kept for the backward
        calls = zip(plan.spans, plan.key_ranges, plan.call_masks, plan.call_no_key, strict=True)
        for (s, e), (lo, hi), m, no_key in calls:
            q_calls.append(plan.query_rows(q_BHQD, s, e))
            o_c, lse_c = _flash(q_calls[-1], k0[:, :, lo:hi], v0[:, :, lo:hi], attn_mask=m, scale=scale)
            if no_key is not None:
                # the kernel reports 0 for rows without keys; out of place: a selective activation
                # checkpoint may keep the kernel's outputs for the recompute (parallel/checkpointing.py)
                lse_c = lse_c.masked_fill(no_key, float("-inf"))
            plan.put_rows(out, o_c, s, e)
            plan.put_rows(lse[..., None], lse_c[..., None], s, e)
        # part B: noisy queries against their own block of x_t, then the exact merge on x_t's rows
        qkv_b = plan.blocks(q_BHQD), plan.blocks(k_BKSD), plan.blocks(v_BKSD)
        o_b, lse_b = _flash(*qkv_b, attn_mask=plan.b_mask, scale=scale)
        n, bs = N // plan.block_size, plan.block_size
        lse_b = plan.unblocks(lse_b[..., None], B).reshape(B, H, N)
        if plan.b_no_key is not None:
            lse_b = lse_b.masked_fill(plan.b_no_key, float("-inf"))
        lse_a = lse[:, :, :N]
        merged = _neginf_to_zero(torch.logaddexp(lse_a, lse_b))  # no key at all: out 0, lse 0
        w_a, w_b = torch.exp(lse_a - merged), torch.exp(lse_b - merged)
        o_a = plan.rows5(out)  # in place on x_t's rows: out = w_a * o_a + w_b * o_b
        o_a.mul_(w_a.view(B, H, n, bs, 1)).addcmul_(plan.unblocks(o_b, B), w_b.view(B, H, n, bs, 1))
        lse_a.copy_(merged)
        if not plan.noisy_only and any(t is not None for t in plan.call_no_key):
            _neginf_to_zero(lse[:, :, N:])  # clean rows without keys (key padding)
        out = out.to(q_BHQD.dtype)
        # q itself is not kept: its chunk rows and blocks are (copies made above, or views of it)
        ctx.save_for_backward(k_BKSD, v_BKSD, out, lse, *qkv_b, *q_calls)
        ctx.plan, ctx.scale, ctx.q_meta = plan, scale, (q_BHQD.shape, q_BHQD.dtype)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_BHQD):  # type: ignore[override]
        k, v, out, lse, q_b, k_b, v_b, *q_calls = ctx.saved_tensors
        plan: Plan = ctx.plan
        (B, H, Q, D), q_dtype = ctx.q_meta
        L, N = plan.seq_len, plan.noisy_len
        grad = _dense_rows(grad_BHQD)  # any strides the kernel reads (an expanded gradient is made dense)
        acc = lse.dtype
        dq = _rows_major(B, H, Q, D, acc, k.device)  # every row written by part A
        dk0 = dv0 = None  # x_0's key gradients: summed over the chunks, from the last (all keys) down
        k0, v0 = k[:, :, N:], v[:, :, N:]
        calls = zip(plan.spans, plan.key_ranges, plan.call_masks, q_calls, strict=True)
        for (s, e), (lo, hi), m, q_c in reversed(list(calls)):
            g_c, o_c = plan.query_rows(grad, s, e), plan.query_rows(out, s, e)
            lse_c = plan.query_rows(lse[..., None], s, e)[..., 0].contiguous()
            dq_c, dk_c, dv_c = _flash_backward(
                g_c, q_c, k0[:, :, lo:hi], v0[:, :, lo:hi], o_c, lse_c, 0.0, False, attn_mask=m, scale=ctx.scale
            )
            plan.put_rows(dq, dq_c, s, e)
            if dk0 is None or dv0 is None:
                if (lo, hi) == (0, L):  # the last chunk sees every key: its fresh outputs are summed into
                    dk0, dv0 = dk_c.to(acc), dv_c.to(acc)
                    continue
                dk0, dv0 = (_rows_major(B, k.shape[1], L, D, acc, k.device).zero_() for _ in range(2))
            dk0[:, :, lo:hi] += dk_c
            dv0[:, :, lo:hi] += dv_c
        assert dk0 is not None and dv0 is not None
        lse_blocks = plan.blocks(lse[:, :, :N, None])[..., 0].contiguous()
        dq_b, dk_b, dv_b = _flash_backward(
            plan.blocks(grad), q_b, k_b, v_b, plan.blocks(out), lse_blocks, 0.0, False, attn_mask=plan.b_mask,
            scale=ctx.scale,
        )  # fmt: skip
        plan.rows5(dq).add_(plan.unblocks(dq_b, B))
        dk, dv = _rows_major(*k.shape, acc, k.device), _rows_major(*v.shape, acc, v.device)
        plan.rows5(dk).copy_(plan.unblocks(dk_b, B))  # x_t's keys: only their own block's queries
        plan.rows5(dv).copy_(plan.unblocks(dv_b, B))
        dk[:, :, N:] = dk0
        dv[:, :, N:] = dv0
        return dq.to(q_dtype), dk.to(k.dtype), dv.to(v.dtype), None
