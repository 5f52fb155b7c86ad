"""Attention masks (pure mask functions, dense_mask) and the SDPA backend against a plain reference.

Shapes: B batch, H query heads, K key/value heads, Q query length, S key length, D head width.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import (
    AttentionMask,
    and_masks,
    bidirectional,
    causal,
    dense_mask,
    key_padding,
    mask_mod,
    same_document,
)

CPU = torch.device("cpu")


# --------------------------------------------------------------------------------------------------
# plain references, written independently of dllm.attention.masks


def reference_allowed(mask: AttentionMask, B: int, Q: int, S: int) -> torch.Tensor:
    """bool [B, 1, Q, S] built with explicit loops."""
    out = torch.zeros(B, 1, Q, S, dtype=torch.bool)
    for b in range(B):
        for i in range(Q):
            for j in range(S):
                ok = True
                if mask.kind == "causal":
                    ok = ok and i >= j
                if mask.doc_ids_BL is not None:
                    ok = ok and bool(mask.doc_ids_BL[b, i] == mask.doc_ids_BL[b, j])
                if mask.key_valid_BL is not None:
                    ok = ok and bool(mask.key_valid_BL[b, j])
                out[b, 0, i, j] = ok
    return out


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D)) V with -inf outside the mask; GQA by repeating k/v heads."""
    H, K, D = q.shape[1], k.shape[1], q.shape[-1]
    k = k.repeat_interleave(H // K, dim=1)
    v = v.repeat_interleave(H // K, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return probs @ v


def make_qkv(B, H, K, Q, S, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Q, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(B, K, S, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(B, K, S, D, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


# B = 2, L = 8. Every query keeps at least one allowed key in every case below.
KEY_VALID = torch.tensor([[False, False, True, True, True, True, True, True], [True] * 6 + [False] * 2])
KEY_VALID_RIGHT = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 2, 2, 3, 3]])
# with KEY_VALID, DOC_IDS would leave row 1 document 3 with padding keys only; this layout keeps a
# valid key in every document
DOC_IDS_WITH_PAD = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 2, 2, 2, 2]])

CASES = {
    "bidirectional": AttentionMask("bidirectional"),
    "causal": AttentionMask("causal"),
    "padding": AttentionMask("bidirectional", key_valid_BL=KEY_VALID),
    "causal_padding_right": AttentionMask("causal", key_valid_BL=KEY_VALID_RIGHT),
    "documents": AttentionMask("bidirectional", doc_ids_BL=DOC_IDS),
    "causal_documents": AttentionMask("causal", doc_ids_BL=DOC_IDS),
    "padding_documents": AttentionMask("bidirectional", key_valid_BL=KEY_VALID, doc_ids_BL=DOC_IDS_WITH_PAD),
}


# --------------------------------------------------------------------------------------------------
# masks


def test_attention_mask_is_frozen_and_plain_flag():
    m = AttentionMask()
    assert m.kind == "bidirectional" and m.is_plain
    assert AttentionMask("causal").is_plain
    assert not AttentionMask(key_valid_BL=KEY_VALID).is_plain
    assert not AttentionMask(doc_ids_BL=DOC_IDS).is_plain
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.kind = "causal"  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(CASES))
def test_dense_mask_matches_loop_reference(name):
    mask = CASES[name]
    dense = dense_mask(mask_mod(mask), 2, 8, 8, CPU)
    assert dense.shape == (2, 1, 8, 8)
    assert dense.dtype == torch.bool
    assert torch.equal(dense, reference_allowed(mask, 2, 8, 8))


def test_causal_and_bidirectional_dense_rectangular():
    c = dense_mask(causal(), 3, 4, 6, CPU)
    assert c.shape == (3, 1, 4, 6)
    expected = torch.ones(4, 6, dtype=torch.bool).tril()
    for b in range(3):
        assert torch.equal(c[b, 0], expected)
    bi = dense_mask(bidirectional(), 2, 4, 6, CPU)
    assert bi.shape == (2, 1, 4, 6) and bool(bi.all())


def test_key_padding_and_same_document_functions():
    kp = dense_mask(key_padding(KEY_VALID), 2, 8, 8, CPU)
    # every query row equals the key validity of its batch row
    assert torch.equal(kp[:, 0], KEY_VALID[:, None, :].expand(2, 8, 8))
    sd = dense_mask(same_document(DOC_IDS), 2, 8, 8, CPU)
    assert torch.equal(sd[:, 0], DOC_IDS[:, :, None] == DOC_IDS[:, None, :])
    # symmetric and reflexive
    assert torch.equal(sd, sd.transpose(-1, -2))
    assert bool(sd[:, 0].diagonal(dim1=-2, dim2=-1).all())


def test_and_masks_is_intersection():
    both = dense_mask(and_masks(causal(), same_document(DOC_IDS), key_padding(KEY_VALID)), 2, 8, 8, CPU)
    parts = [dense_mask(m, 2, 8, 8, CPU) for m in (causal(), same_document(DOC_IDS), key_padding(KEY_VALID))]
    assert torch.equal(both, parts[0] & parts[1] & parts[2])
    single = dense_mask(and_masks(causal()), 2, 8, 8, CPU)
    assert torch.equal(single, parts[0])


def test_mask_mod_of_plain_descriptions():
    assert torch.equal(dense_mask(mask_mod(AttentionMask("causal")), 1, 5, 5, CPU), dense_mask(causal(), 1, 5, 5, CPU))
    assert bool(dense_mask(mask_mod(AttentionMask()), 1, 5, 5, CPU).all())


# --------------------------------------------------------------------------------------------------
# SDPA backend vs the reference


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa2", "mqa"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_matches_reference_outputs_and_grads(name, heads, dtype):
    H, K = heads
    mask = CASES[name]
    q, k, v = make_qkv(2, H, K, 8, 8, 6, dtype)
    tol = 1e-5 if dtype == torch.float32 else 1e-10

    out = sdpa_attention(q, k, v, mask)
    assert out.shape == (2, H, 8, 6) and out.dtype == dtype
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))

    ref = reference_attention(q, k, v, reference_allowed(mask, 2, 8, 8))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))

    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    for g_out, g_ref, which in zip(grads, ref_grads, "qkv", strict=True):
        assert g_out.shape == g_ref.shape, which
        torch.testing.assert_close(g_out, g_ref, atol=tol, rtol=tol, msg=f"grad {which} ({name})")


@pytest.mark.parametrize("kind", ["bidirectional", "causal"])
def test_sdpa_plain_rectangular_matches_reference(kind):
    """Fewer queries than keys (top-left aligned, as the mask function q >= kv says)."""
    q, k, v = make_qkv(2, 4, 2, 4, 6, 8, torch.float64)
    mask = AttentionMask(kind)
    out = sdpa_attention(q, k, v, mask)
    ref = reference_attention(q, k, v, reference_allowed(mask, 2, 4, 6))
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-10)


def test_sdpa_padding_keys_do_not_influence_output():
    """Changing k/v at padded keys changes nothing."""
    q, k, v = make_qkv(2, 4, 2, 8, 8, 6, torch.float64)
    mask = CASES["padding"]
    out = sdpa_attention(q, k, v, mask)
    k2, v2 = k.detach().clone(), v.detach().clone()
    pad = ~KEY_VALID
    k2.permute(0, 2, 1, 3)[pad] = 100.0
    v2.permute(0, 2, 1, 3)[pad] = -50.0
    out2 = sdpa_attention(q, k2, v2, mask)
    torch.testing.assert_close(out, out2, atol=1e-12, rtol=0)


def test_sdpa_documents_equal_separate_sequences():
    """Attention inside documents equals running each document on its own."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 4, torch.float64)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    out = sdpa_attention(q, k, v, AttentionMask("bidirectional", doc_ids_BL=doc))
    for lo, hi in [(0, 3), (3, 7), (7, 8)]:
        sl = slice(lo, hi)
        part = sdpa_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl], AttentionMask("bidirectional"))
        torch.testing.assert_close(out[:, :, sl], part, atol=1e-12, rtol=1e-12)


def test_sdpa_fully_masked_query_rows_are_finite():
    """A query with no allowed key (a padding-only document) must not produce NaN."""
    q, k, v = make_qkv(1, 2, 2, 4, 4, 4, torch.float32)
    mask = AttentionMask(
        "bidirectional",
        key_valid_BL=torch.tensor([[True, True, False, False]]),
        doc_ids_BL=torch.tensor([[0, 0, 1, 1]]),
    )
    out = sdpa_attention(q, k, v, mask)
    assert bool(torch.isfinite(out).all())
    out.sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (q, k, v))
    # the rows that do have keys agree with the reference
    ref = reference_attention(q, k, v, reference_allowed(mask, 1, 4, 4))
    torch.testing.assert_close(out[:, :, :2], ref[:, :, :2], atol=1e-5, rtol=1e-5)
