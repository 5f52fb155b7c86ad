"""The fused CPU kernel for BD3LM's block-diffusion attention (bd_fused) against the dense SDPA reference.

Covers: all 2L queries and x_t's L queries alone; documents (one run of positions each), a window and
both; block = 1, block = L, L not a multiple of the query tile, tiles and key pieces smaller than the
defaults (several pieces per row, partial vector lanes); MHA / GQA / MQA; the model's row-major
layout and a stride-0 gradient; outputs and gradients w.r.t. q, k, v; results independent of the
thread count; which calls it takes (and which go to bd_split), and the fallback without a compiler.
"""

from __future__ import annotations

import pytest
import torch

import dllm.attention.backends.bd_fused as bd_fused
import dllm.attention.backends.bd_split as bd_split
from dllm.attention.backends.blockwise import blockwise_attention
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask

needs_kernel = pytest.mark.skipif(not bd_fused.available(), reason="fused kernel not built here (no C compiler?)")


def doc_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Different random document boundaries in every batch row (each document one run)."""
    starts = torch.rand(batch, seq, generator=torch.Generator().manual_seed(seed)) < 0.12
    return starts.long().cumsum(dim=1)


def qkv(batch, heads, seq, d, q_len, seed=0, row_major=False):
    g = torch.Generator().manual_seed(seed)
    shapes = ((batch, heads[0], q_len, d), (batch, heads[1], 2 * seq, d), (batch, heads[1], 2 * seq, d))
    out = []
    for shape in shapes:
        t = torch.randn(*shape, generator=g)
        if row_major:  # the model's projections: [B, S, H, D] seen as [B, H, S, D]
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        out.append(t.requires_grad_(True))
    return out


def assert_matches_reference(mask, batch, heads, seq, d, noisy_only, row_major=False, plain_sum=False):
    q, k, v = qkv(batch, heads, seq, d, seq if noisy_only else 2 * seq, row_major=row_major)
    out = bd_fused.fused_attention(q, k, v, mask)
    ref = sdpa_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    w = torch.ones(out.shape) if plain_sum else torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    loss, ref_loss = (out.sum(), ref.sum()) if plain_sum else ((out * w).sum(), (ref * w).sum())
    got = torch.autograd.grad(loss, (q, k, v))  # a plain sum hands over an expanded (stride 0) gradient
    want = torch.autograd.grad(ref_loss, (q, k, v))
    for g_out, g_ref, which in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g_out, g_ref, atol=2e-5, rtol=2e-5, msg=f"grad {which}")


def pattern(name: str, batch: int, seq: int) -> dict:
    docs, window = {"doc_ids_BL": doc_ids(batch, seq, seq)}, {"window": max(2, seq // 3)}
    return {"alone": {}, "docs": docs, "window": window, "both": {**docs, **window}}[name]


@needs_kernel
@pytest.mark.parametrize("extra", ["alone", "docs", "window", "both"])
@pytest.mark.parametrize(("seq", "block"), [(64, 8), (48, 16), (16, 1), (32, 32), (200, 8), (96, 4)])
@pytest.mark.parametrize("noisy_only", [False, True], ids=["both_halves", "noisy_queries"])
def test_fused_equals_sdpa(seq, block, extra, noisy_only):
    """(200, 8): L is no multiple of the 64-row query tile; block = 1 and block = L are the edges."""
    mask = AttentionMask("block_diffusion", block_size=block, **pattern(extra, 3, seq))
    assert_matches_reference(mask, 3, (4, 2), seq, 8, noisy_only)


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1), (6, 2)], ids=["mha", "gqa", "mqa", "gqa3"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_heads_and_batch(heads, batch):
    mask = AttentionMask("block_diffusion", block_size=4, **pattern("docs", batch, 40))
    assert_matches_reference(mask, batch, heads, 40, 16, noisy_only=False)


@needs_kernel
@pytest.mark.parametrize("noisy_only", [False, True], ids=["both_halves", "noisy_queries"])
def test_fused_small_tiles_and_odd_head_width(monkeypatch, noisy_only):
    """Query tiles of 12 rows (not block-aligned), key pieces of 20 (several per row, tails of the
    8-lane loops) and D = 13."""
    monkeypatch.setattr(bd_fused, "QUERY_TILE", 12)
    monkeypatch.setattr(bd_fused, "KEY_TILE", 20)
    mask = AttentionMask("block_diffusion", block_size=4, **pattern("both", 2, 72))
    assert_matches_reference(mask, 2, (4, 2), 72, 13, noisy_only)


@needs_kernel
@pytest.mark.parametrize("noisy_only", [False, True], ids=["both_halves", "noisy_queries"])
def test_fused_reads_the_models_layout_and_an_expanded_gradient(noisy_only):
    mask = AttentionMask("block_diffusion", block_size=8, **pattern("docs", 2, 32))
    assert_matches_reference(mask, 2, (4, 2), 32, 8, noisy_only, row_major=True, plain_sum=True)


@needs_kernel
def test_fused_is_the_same_on_one_and_two_threads():
    """Each (batch, head) task owns its rows and its key gradients: no order depends on threads."""
    mask = AttentionMask("block_diffusion", block_size=8, **pattern("docs", 2, 64))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            q, k, v = qkv(2, (4, 2), 64, 8, 128)
            out = bd_fused.fused_attention(q, k, v, mask)
            results.append([out, *torch.autograd.grad(out.square().sum(), (q, k, v))])
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_document_ranges_are_each_positions_run():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 3, 3]])
    mask = AttentionMask("block_diffusion", block_size=2, doc_ids_BL=ids)
    lo, hi = bd_fused.document_ranges(mask)
    assert lo.tolist() == [[0, 0, 2, 2, 2, 5], [0, 0, 0, 0, 4, 4]]
    assert hi.tolist() == [[2, 2, 5, 5, 5, 6], [4, 4, 4, 4, 6, 6]]
    assert bd_fused.document_ranges(mask)[0] is lo  # once per description (every layer shares it)
    split_doc = AttentionMask("block_diffusion", block_size=2, doc_ids_BL=torch.tensor([[0, 0, 1, 1, 0, 0]]))
    assert bd_fused.document_ranges(split_doc) is None  # document 0 is two runs: not one range


def test_which_calls_the_fused_kernel_takes(monkeypatch):
    monkeypatch.setattr(bd_fused, "available", lambda: True)
    q, k, _ = qkv(2, (4, 2), 16, 8, 32)
    plain = AttentionMask("block_diffusion", block_size=4)
    assert bd_fused.supports(q, k, plain)
    assert bd_fused.supports(q[:, :, :16], k, plain)  # x_t's queries alone
    docs_and_window = AttentionMask("block_diffusion", block_size=4, window=3, doc_ids_BL=doc_ids(2, 16, 0))
    assert bd_fused.supports(q, k, docs_and_window)
    pad = torch.ones(2, 16, dtype=torch.bool)
    pad[0, :3] = False
    assert not bd_fused.supports(q, k, AttentionMask("block_diffusion", block_size=4, key_valid_BL=pad))
    two_runs = torch.tensor([[0] * 4 + [1] * 4 + [0] * 8] * 2)
    assert not bd_fused.supports(q, k, AttentionMask("block_diffusion", block_size=4, doc_ids_BL=two_runs))
    assert not bd_fused.supports(q.bfloat16(), k.bfloat16(), plain)
    assert not bd_fused.supports(q, k, AttentionMask("block_diffusion", block_size=3))  # 3 does not divide 16
    assert not bd_fused.supports(q, k, AttentionMask("block_causal", block_size=4))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)  # fewer (batch, head) tasks than threads
    assert not bd_fused.supports(q, k, plain)


def test_blockwise_routes_between_the_fused_kernel_and_the_split_path(monkeypatch):
    calls = []
    monkeypatch.setattr(bd_fused, "available", lambda: True)
    monkeypatch.setattr(bd_fused, "fused_attention", lambda *a: calls.append("fused") or a[0])
    monkeypatch.setattr(bd_split, "split_attention", lambda *a: calls.append("split") or a[0])
    q, k, v = qkv(2, (4, 2), 16, 8, 32)
    blockwise_attention(q, k, v, AttentionMask("block_diffusion", block_size=4))
    blockwise_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), AttentionMask("block_diffusion", block_size=4))
    monkeypatch.setattr(bd_fused, "available", lambda: False)  # no compiler, or DLLM_FUSED_ATTENTION=0
    blockwise_attention(q, k, v, AttentionMask("block_diffusion", block_size=4))
    assert calls == ["fused", "split", "split"]


def test_without_a_compiler_the_kernel_is_unavailable_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("DLLM_CACHE_DIR", str(tmp_path))
    bd_fused._library.cache_clear()
    bd_fused.available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not bd_fused.available()
        assert "no C compiler" in caplog.text
        assert not list(tmp_path.glob("kernels/*.so"))
    finally:
        bd_fused._library.cache_clear()
        bd_fused.available.cache_clear()


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("DLLM_FUSED_ATTENTION", "0")
    bd_fused.available.cache_clear()
    try:
        assert not bd_fused.available()
    finally:
        bd_fused.available.cache_clear()
