"""Blockwise backend: exact block-sparse attention as a few dense SDPA calls over block-aligned query chunks.

BD3LM's training mask over [x_t ; x_0] (Arriola et al. 2025, Sec. 3.2) allows L*L + L*B of the 4*L*L
pairs, and FlexAttention (which would skip the rest) has no CPU backward. This backend splits the L
positions into `num_chunks` block-aligned chunks [s, e) and runs one SDPA call per chunk:

- block_diffusion: queries x_t[s:e] and x_0[s:e] (2*Lc rows), keys x_0[0:e] and x_t[s:e]. A noisy query
  sees its own block of x_t and earlier blocks of x_0, a clean query x_0 up to its own block (BD3LM's
  block-diagonal + offset block-causal + block-causal parts), so every allowed key of every query row
  is in its call: the softmax is the dense one, no online-softmax merging. With S equal chunks the
  calls score L*L*(S+3)/S pairs instead of 4*L*L (S = 8: 2.9x fewer).
- block_causal: queries [s, e), keys [0, e): L*L*(S+1)/(2S) pairs instead of L*L.
- a window also drops keys more than `window` positions before the chunk (they are masked anyway).

Each chunk's bool mask is the shared mask function (`mask_mod(mask, S)`) evaluated at the global query
and key indices, so documents, padding and windows are exact by construction. Chunk masks are built
once per description and shape (`AttentionMask.cache`) and shared by all layers. Any other call is
the SDPA reference: plain masks take its mask-free kernels (as `auto` does, so a run resolved from
`auto` to `blockwise` computes the same), and bidirectional / causal masks with documents, padding or
a window, q and k of different lengths, or one chunk take the dense mask. Causal masks with documents
were once chunked here as blocks of one token: forward + backward measured 1.4-2.2x slower than the
dense mask (CPU, 2 threads, B 8, H 4, K 2, D 32, L = 512 and 1024, ~20-token documents), and `auto`
never sent them here.

`DEFAULT_NUM_CHUNKS` was measured with bench/attention.py --chunk-counts (CPU, 1 thread, B2 H8 D64,
block 32, 2L = 1024 and 2048): forward + backward 1.9-2.8x faster than the dense mask at 6-12 chunks
(within noise of each other), less at 2, 4 and 16; 8 was chosen. Cost: each call's q/k/v chunks are
copies saved for backward (keys ~(S/2 + 2) * L rows per k/v tensor instead of 2L).

On CPU, block_diffusion takes the split path instead (bd_split.py): the same chunks against x_0's
keys only plus one batched call for x_t's own blocks, merged exactly with log-sum-exp statistics
(1.16*L*L pairs at S = 8, no gathered k/v copies). `chunked_attention` is the one-call-per-chunk
path for every other device and pattern, and both are tested against the dense SDPA reference.

Shapes: B batch, H query heads, K key/value heads, L query length, S key length, D head width,
Q / C rows of one chunk's queries / keys.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dllm.attention.backends import bd_split
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.backends.spans import Span, chunk_spans
from dllm.attention.masks import BLOCK_KINDS, AttentionMask, MaskMod, depends_on_batch, layout_length, mask_mod

DEFAULT_NUM_CHUNKS = 8
"""Query chunks per call (capped at the number of blocks); measured with bench/attention.py."""


@dataclass(frozen=True)
class Chunk:
    """One SDPA call: which rows of q it computes and which rows of k/v those queries may attend to."""

    query_spans: tuple[Span, ...]
    key_spans: tuple[Span, ...]


def blockwise_attention(
    q_BHLD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    mask: AttentionMask,
    num_chunks: int = DEFAULT_NUM_CHUNKS,
) -> torch.Tensor:
    """q [B, H, L, D], k/v [B, K, S, D] -> [B, H, L, D]; equal to `sdpa_attention` up to float rounding."""
    if bd_split.supports(q_BHLD, k_BKSD, mask):  # CPU block diffusion: two exact parts merged (bd_split.py)
        return bd_split.split_attention(q_BHLD, k_BKSD, v_BKSD, mask, num_chunks)
    return chunked_attention(q_BHLD, k_BKSD, v_BKSD, mask, num_chunks)


def chunked_attention(
    q_BHLD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    mask: AttentionMask,
    num_chunks: int = DEFAULT_NUM_CHUNKS,
) -> torch.Tensor:
    """One SDPA call per chunk of `chunk_plan` (any device); the dense reference when there is no plan."""
    chunks = chunk_plan(mask, q_BHLD.shape[2], k_BKSD.shape[2], num_chunks)
    if chunks is None:
        return sdpa_attention(q_BHLD, k_BKSD, v_BKSD, mask)
    masks_B1QC = chunk_masks(mask, chunks, q_BHLD.shape[0], k_BKSD.shape[2], q_BHLD.device)
    gqa = k_BKSD.shape[1] != q_BHLD.shape[1]
    outs_BHQD = []
    for chunk, mask_B1QC in zip(chunks, masks_B1QC, strict=True):
        q_BHQD = gather(q_BHLD, chunk.query_spans)
        k_BKCD, v_BKCD = gather(k_BKSD, chunk.key_spans), gather(v_BKSD, chunk.key_spans)
        outs_BHQD.append(F.scaled_dot_product_attention(q_BHQD, k_BKCD, v_BKCD, attn_mask=mask_B1QC, enable_gqa=gqa))
    return in_sequence_order(outs_BHQD, chunks)


def chunk_plan(mask: AttentionMask, q_len: int, kv_len: int, num_chunks: int) -> tuple[Chunk, ...] | None:
    """The calls that cover every query with all its allowed keys; None when SDPA is the path (not a block
    pattern, a query offset, or one chunk)."""
    if num_chunks < 1:
        raise ValueError(f"blockwise attention needs num_chunks >= 1, got {num_chunks}")
    views = mask.views  # noisy copies before x_0 in the block_diffusion layout
    noisy_only = mask.kind == "block_diffusion" and (views + 1) * q_len == views * kv_len  # only x_t's outputs
    if mask.kind not in BLOCK_KINDS or mask.query_offset or mask.query_offset_B is not None:
        return None
    if q_len != kv_len and not noisy_only:
        return None
    seq_len = layout_length(mask, kv_len)  # L; raises on a bad 2L length before any slicing
    assert seq_len is not None and mask.block_size is not None  # kv_len is given; block kinds have one
    spans = chunk_spans(seq_len, mask.block_size, num_chunks)
    if len(spans) == 1:
        return None  # one chunk holds every key: the dense call itself
    reach = mask.window - 1 if mask.window is not None else seq_len  # keys before s - reach are out of the window
    if mask.kind == "block_diffusion":
        # BD3LM 2L layout: x_t rows [s, e) and x_0 rows L + [s, e); keys x_0[:e] and x_t[s:e]. In a last
        # layer whose x_0 outputs are unused the queries are x_t's only (q is the first L rows). With V
        # noisy copies, x_0 starts at V L and each copy v adds its rows v L + [s, e) to queries and keys.
        clean, L = views * seq_len, seq_len
        noisy = lambda s, e: tuple((v * L + s, v * L + e) for v in range(views))  # noqa: E731
        return tuple(
            Chunk(noisy(s, e) if noisy_only else (*noisy(s, e), (clean + s, clean + e)),
                  ((clean + max(0, s - reach), clean + e), *noisy(s, e)))
            for s, e in spans
        )  # fmt: skip
    return tuple(Chunk(((s, e),), ((max(0, s - reach), e),)) for s, e in spans)


def chunk_masks(
    mask: AttentionMask, chunks: tuple[Chunk, ...], batch: int, kv_len: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """Bool [B or 1, 1, Q, C] per chunk from the shared mask function, built once per description and shape."""
    mask_batch = batch if depends_on_batch(mask) else 1  # broadcast over batch when the pattern allows
    key = ("blockwise", chunks, mask_batch, kv_len, device)

    def build() -> tuple[torch.Tensor, ...]:
        mod = mask_mod(mask, kv_len)
        return tuple(span_mask(mod, mask_batch, c.query_spans, c.key_spans, device) for c in chunks)

    return mask.cache.memo(key, build)


def span_mask(
    mod: MaskMod, batch: int, query_spans: tuple[Span, ...], key_spans: tuple[Span, ...], device: torch.device
) -> torch.Tensor:
    """Evaluate a mask function at global query x key indices: bool [B, 1, Q, C]."""
    b = torch.arange(batch, device=device)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = span_indices(query_spans, device)[None, None, :, None]
    kv = span_indices(key_spans, device)[None, None, None, :]
    return mod(b, h, q, kv).expand(batch, 1, q.shape[2], kv.shape[3])


def span_indices(spans: tuple[Span, ...], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s, e, device=device) for s, e in spans])


def gather(x_BHSD: torch.Tensor, spans: tuple[Span, ...]) -> torch.Tensor:
    """Rows `spans` of the sequence dim, in order (a view for one span; autograd flows through slice/cat)."""
    parts = [x_BHSD[:, :, s:e] for s, e in spans]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def in_sequence_order(outs_BHQD: list[torch.Tensor], chunks: tuple[Chunk, ...]) -> torch.Tensor:
    """Write chunk outputs back in the original order: the query spans of all chunks partition [0, L)."""
    pieces: list[tuple[int, torch.Tensor]] = []
    for out_BHQD, chunk in zip(outs_BHQD, chunks, strict=True):
        sizes = [e - s for s, e in chunk.query_spans]
        pieces += zip((s for s, _ in chunk.query_spans), out_BHQD.split(sizes, dim=2), strict=True)
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim=2)


def blockwise_backend(flex_compile: bool) -> Callable[..., torch.Tensor]:
    """The registered factory of `blockwise` (no options)."""
    return blockwise_attention
