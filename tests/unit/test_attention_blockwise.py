"""The `blockwise` backend (exact block-sparse SDPA over query chunks) against the dense SDPA reference.

Covers: block_diffusion (BD3LM 2L layout, and two noisy copies sharing x_0: 3L) over several (L, block,
chunks) including uneven chunks, block = L, block = 1, more chunks than blocks; with batch-dependent
documents, key padding (a row with no allowed key included), a window and all of them; GQA / MQA /
MHA, batch 1 and 3; block_causal and causal with documents; outputs and gradients w.r.t. q, k, v.
Also: every allowed pair lies in one chunk, the fallback kinds are the reference, the chunk-mask
cache, and `auto`'s CPU routing.

Shapes: B batch, H query heads, K key/value heads, L sequence (block_diffusion runs on S = 2L), D head width.
"""

from __future__ import annotations

import pytest
import torch

import dllm.attention.backends.blockwise as blockwise_module
from dllm.attention.backends import make_attention
from dllm.attention.backends.auto import choose_backend
from dllm.attention.backends.bd_split import split_attention
from dllm.attention.backends.blockwise import blockwise_attention, chunk_plan, chunked_attention, span_indices
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask, dense_mask, mask_mod

CPU = torch.device("cpu")
D = 8


def doc_ids_BL(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Different random document boundaries in every batch row."""
    starts = torch.rand(batch, seq, generator=torch.Generator().manual_seed(seed)) < 0.15
    return starts.long().cumsum(dim=1)


def key_valid_BL(batch: int, seq: int) -> torch.Tensor:
    """Row 0 left-padded (its first queries may see no key at all), the others right-padded by row."""
    valid = torch.ones(batch, seq, dtype=torch.bool)
    valid[0, : seq // 4] = False
    for b in range(1, batch):
        valid[b, seq - 3 * b :] = False
    return valid


def extras(name: str, batch: int, seq: int) -> dict:
    docs, pad = {"doc_ids_BL": doc_ids_BL(batch, seq, seq)}, {"key_valid_BL": key_valid_BL(batch, seq)}
    window = {"window": max(2, seq // 3)}
    return {"alone": {}, "docs": docs, "pad": pad, "window": window, "all": {**docs, **pad, **window}}[name]


def make_qkv(batch: int, heads: tuple[int, int], S: int, seed: int = 0, q_len: int | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = (q_len or S, S, S)
    return [
        torch.randn(batch, n, s, D, generator=g, requires_grad=True)
        for n, s in zip((heads[0], heads[1], heads[1]), lens, strict=True)
    ]


IMPLS = {"blockwise": blockwise_attention, "split": split_attention, "chunked": chunked_attention}


def assert_equals_sdpa(
    mask: AttentionMask,
    batch: int,
    heads: tuple[int, int],
    S: int,
    num_chunks: int,
    impl: str = "blockwise",
    q_len: int | None = None,
) -> None:
    q, k, v = make_qkv(batch, heads, S, q_len=q_len)
    out = IMPLS[impl](q, k, v, mask, num_chunks=num_chunks)
    ref = sdpa_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g_out, g_ref, which in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5, msg=f"grad {which}")


# (L, block, chunks): uneven chunks (8 blocks / 3, 3 blocks / 2), one block per chunk, block = 1,
# more chunks than blocks, the default chunk count, block = L (one chunk: the dense call itself)
BD_CASES = [(64, 8, 3), (48, 16, 2), (32, 8, 4), (16, 1, 5), (24, 8, 100), (64, 4, 8), (32, 32, 4)]


@pytest.mark.parametrize("extra", ["alone", "docs", "pad", "window", "all"])
@pytest.mark.parametrize(("seq", "block", "num_chunks"), BD_CASES)
@pytest.mark.parametrize("impl", ["split", "chunked"])
@pytest.mark.parametrize("noisy_only", [False, True], ids=["both_halves", "noisy_queries"])
def test_block_diffusion_equals_sdpa(seq, block, num_chunks, extra, impl, noisy_only):
    """Both exact paths (CPU split into two merged parts, one call per chunk) on all 2L queries, and on
    x_t's L queries only (a last layer whose x_0 outputs are unused)."""
    mask = AttentionMask("block_diffusion", block_size=block, **extras(extra, 3, seq))
    q_len = seq if noisy_only else 2 * seq
    assert (chunk_plan(mask, q_len, 2 * seq, num_chunks) is None) == (block == seq)
    assert_equals_sdpa(mask, 3, (4, 2), 2 * seq, num_chunks, impl=impl, q_len=q_len)


# (L, block, chunks) for the layout of two noisy copies sharing x_0 (3L rows): uneven chunks, block = 1,
# more chunks than blocks, block = L (one chunk)
VIEWS_CASES = [(32, 8, 3), (16, 1, 5), (24, 8, 100), (16, 16, 2)]


@pytest.mark.parametrize("extra", ["alone", "docs", "all"])
@pytest.mark.parametrize(("seq", "block", "num_chunks"), VIEWS_CASES)
@pytest.mark.parametrize("impl", ["split", "chunked"])
@pytest.mark.parametrize("noisy_only", [False, True], ids=["all_rows", "noisy_queries"])
def test_shared_clean_views_equal_sdpa(seq, block, num_chunks, extra, impl, noisy_only):
    """[x_t^1 ; x_t^2 ; x_0] (Fast-dLLM v2's two views over one clean stream): both exact paths equal the
    dense reference on all 3L queries and on the 2L noisy ones, outputs and gradients."""
    mask = AttentionMask("block_diffusion", block_size=block, views=2, **extras(extra, 3, seq))
    q_len = 2 * seq if noisy_only else 3 * seq
    assert (chunk_plan(mask, q_len, 3 * seq, num_chunks) is None) == (block == seq)
    assert_equals_sdpa(mask, 3, (4, 2), 3 * seq, num_chunks, impl=impl, q_len=q_len)


@pytest.mark.parametrize("extra", ["alone", "all"])
def test_shared_clean_views_are_two_separate_rows(extra):
    """The mask of V copies sharing x_0 is, per copy, the 2L mask [x_t ; x_0], and no copy sees another;
    so each copy's attention output equals a 2L call's, and x_0's rows are the same as well."""
    seq, block = 24, 4
    views = AttentionMask("block_diffusion", block_size=block, views=2, **extras(extra, 2, seq))
    pair = AttentionMask("block_diffusion", block_size=block, **extras(extra, 2, seq))
    big = dense_mask(mask_mod(views, 3 * seq), 2, 3 * seq, 3 * seq, CPU)
    small = dense_mask(mask_mod(pair, 2 * seq), 2, 2 * seq, 2 * seq, CPU)
    for v in range(2):
        rows = torch.cat([torch.arange(v * seq, (v + 1) * seq), torch.arange(2 * seq, 3 * seq)])
        assert torch.equal(big[:, :, rows][..., rows], small)
        other = torch.arange((1 - v) * seq, (2 - v) * seq)
        assert not bool(big[:, :, rows][..., other].any())  # never the other copy (x_0 included)
    q, k, v = (t.detach() for t in make_qkv(2, (4, 2), 3 * seq, seed=3))
    out = split_attention(q, k, v, views, 3)
    for copy in range(2):
        rows = torch.cat([torch.arange(copy * seq, (copy + 1) * seq), torch.arange(2 * seq, 3 * seq)])
        ref = split_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows], pair, 3)
        torch.testing.assert_close(out[:, :, rows], ref, atol=1e-6, rtol=1e-6)


def test_views_only_with_block_diffusion_and_whole_layouts():
    with pytest.raises(ValueError, match="views"):
        AttentionMask("causal", views=2)
    with pytest.raises(ValueError, match="views"):
        AttentionMask("block_diffusion", block_size=4, views=0)
    with pytest.raises(ValueError, match="multiple of 3"):
        mask_mod(AttentionMask("block_diffusion", block_size=4, views=2), 32)


@pytest.mark.parametrize("impl", ["split", "chunked"])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
def test_block_diffusion_heads_and_batch(heads, batch, impl):
    mask = AttentionMask("block_diffusion", block_size=4, **extras("all", batch, 40))
    assert_equals_sdpa(mask, batch=batch, heads=heads, S=80, num_chunks=4, impl=impl)


def test_blockwise_takes_the_split_path_on_cpu(monkeypatch):
    import dllm.attention.backends.bd_split as bd_split

    calls = []
    monkeypatch.setattr(bd_split, "split_attention", lambda *a: calls.append(a) or a[0])
    mask = AttentionMask("block_diffusion", block_size=4)
    blockwise_attention(*make_qkv(1, (2, 2), 16), mask)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_split_in_low_and_high_precision(dtype):
    """bf16 (autocast training) stays within bf16 rounding of the float64 reference; float64 is exact."""
    mask = AttentionMask("block_diffusion", block_size=8, **extras("all", 2, 64))
    q, k, v = (t.detach().double().requires_grad_() for t in make_qkv(2, (4, 2), 128))
    ref = sdpa_attention(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    qd, kd, vd = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = split_attention(qd, kd, vd, mask, 4)
    grads = torch.autograd.grad(out.sum(), (qd, kd, vd))
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-12, "rtol": 1e-12}
    torch.testing.assert_close(out.double(), ref, **tol)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), r, **tol)


@pytest.mark.parametrize("extra", ["alone", "docs", "pad", "window", "all"])
@pytest.mark.parametrize(("kind", "block"), [("block_causal", 4), ("block_causal", 1), ("causal", None)])
def test_block_causal_and_causal_equal_sdpa(kind, block, extra):
    """30 = 7 blocks of 4 + a partial one; causal (not a block pattern) is the SDPA reference itself."""
    mask = AttentionMask(kind, block_size=block, **extras(extra, 3, 30))
    assert (chunk_plan(mask, 30, 30, 3) is None) == (kind == "causal")
    assert_equals_sdpa(mask, batch=3, heads=(4, 2), S=30, num_chunks=3)
    assert_equals_sdpa(mask, batch=3, heads=(4, 2), S=30, num_chunks=3, impl="chunked")


@pytest.mark.parametrize("extra", ["docs", "all"])
def test_noisy_only_plan_is_a_view_of_the_full_plan(extra):
    """A model's last layer (x_t's queries only) after the full layers of the same step reuses the
    full plan's masks as views, and still equals the dense reference (outputs and gradients)."""
    from dllm.attention.backends.bd_split import Plan

    seq, block, chunks = 32, 4, 3
    mask = AttentionMask("block_diffusion", block_size=block, **extras(extra, 3, seq))
    q, k, v = make_qkv(3, (4, 2), 2 * seq)
    split_attention(q, k, v, mask, chunks)  # a full layer builds the plan
    full = Plan.of(mask, q, k, seq, chunks)
    q_t = q[:, :, :seq].detach().clone().requires_grad_(True)
    out = split_attention(q_t, k, v, mask, chunks)
    noisy = Plan.of(mask, q_t, k, seq, chunks)
    assert noisy.noisy_only and not full.noisy_only
    for m_noisy, m_full in zip(noisy.a_masks, full.a_masks, strict=True):
        assert m_noisy.untyped_storage().data_ptr() == m_full.untyped_storage().data_ptr()
    ref = sdpa_attention(q_t, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((out * w).sum(), (q_t, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q_t, k, v))
    for g_out, g_ref in zip(got, want, strict=True):
        torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("noisy_only", [False, True], ids=["both_halves", "noisy_queries"])
@pytest.mark.parametrize("window", [None, 10])
def test_split_leaves_out_keys_no_row_of_a_chunk_sees(window, noisy_only):
    """Documents (and windows) mask whole key ranges of a chunk: those keys are left out of its call,
    including the last chunk's (its gradient then starts from zeros), and the result is still exact."""
    from dllm.attention.backends.bd_split import Plan

    seq, block, chunks = 48, 4, 4
    doc = torch.zeros(3, seq, dtype=torch.long)
    doc[:, 20:] = 1  # a document starts at 20 in every row, and at 30 / 36 in two of them
    doc[1, 30:], doc[2, 36:] = 2, 2
    mask = AttentionMask("block_diffusion", block_size=block, doc_ids_BL=doc, window=window)
    q, k, v = make_qkv(3, (4, 2), 2 * seq, seed=5)
    full = Plan.of(mask, q, k, seq, chunks)
    assert full.spans == [(0, 12), (12, 24), (24, 36), (36, 48)]
    # keys before 20 are in another document for every row from 24 on; a window of 10 also drops the
    # keys more than 9 before a chunk's first row (12 -> 3, 36 -> 27)
    starts = [0, 0, 20, 20] if window is None else [0, 3, 20, 27]
    assert full.key_ranges == [(lo, e) for lo, (_, e) in zip(starts, full.spans, strict=True)]
    assert all(m.shape[-1] == hi - lo for m, (lo, hi) in zip(full.a_masks, full.key_ranges, strict=True))
    # x_t's rows alone (a last layer) see fewer: not their own block's x_0, nothing before a document start
    allowed = dense_mask(mask_mod(mask, 2 * seq), 3, 2 * seq, 2 * seq, CPU)[..., seq:]  # keys: x_0
    noisy = Plan.of(mask, q[:, :, :seq], k, seq, chunks)
    for plan, halves in ((full, (0, seq)), (noisy, (0,))):
        for (s, e), (lo, hi) in zip(plan.spans, plan.key_ranges, strict=True):
            rows = torch.cat([torch.arange(h + s, h + e) for h in halves])
            seen = allowed[:, :, rows].any(dim=(0, 1, 2)).nonzero().flatten()
            assert (lo, hi) == (int(seen[0]), int(seen[-1]) + 1)
    assert noisy.key_ranges[1] == (0 if window is None else 3, 16)  # chunk [12, 24): rows 20-23 start a document
    assert_equals_sdpa(mask, 3, (4, 2), 2 * seq, chunks, impl="split", q_len=seq if noisy_only else None)
    plain = Plan.of(AttentionMask("block_diffusion", block_size=block), q, k, seq, chunks)
    assert plain.key_ranges == [(0, e) for _, e in full.spans]


def test_split_plan_built_once_per_description():
    """The plan lives in the description's cache: the layers of one forward (full layers, then a last
    layer whose queries are x_t's rows only, a view of the full plan) share one build; another
    description builds its own, even an equal one (the next training step)."""
    import dllm.attention.backends.bd_split as bd_split

    q, k, _ = make_qkv(2, (4, 2), 32)
    step1, step2 = (AttentionMask("block_diffusion", block_size=4) for _ in range(2))
    assert step1 == step2 and step1.cache is not step2.cache
    plan = bd_split.Plan.of(step1, q, k, 16, 2)
    assert bd_split.Plan.of(step1, q, k, 16, 2) is plan  # the next layer
    noisy = bd_split.Plan.of(step1, q[:, :, :16], k, 16, 2)  # the last layer
    assert noisy.a_masks[0].untyped_storage().data_ptr() == plan.a_masks[0].untyped_storage().data_ptr()
    assert bd_split.Plan.of(step1, q[:, :, :16], k, 16, 2) is noisy
    assert bd_split.Plan.of(step1, q, k, 16, 4) is not plan  # another chunk count, another plan
    assert bd_split.Plan.of(step2, q, k, 16, 2) is not plan
    assert len(step1.cache) == 3 and len(step2.cache) == 1


def test_split_plan_built_once_per_model_forward(monkeypatch):
    """In a model every layer gets the forward's description: one plan per forward, not per layer or per step."""
    import dllm.attention.backends.bd_split as bd_split
    from dllm.config.model import ModelConfig
    from dllm.models.transformer import Transformer

    builds = []
    real_init = bd_split.Plan.__init__
    monkeypatch.setattr(bd_split.Plan, "__init__", lambda self, *a: builds.append(a[0]) or real_init(self, *a))
    model = Transformer(ModelConfig(preset="tiny", vocab_size=64, num_layers=3))
    model.init_weights(torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).repeat(2).expand(2, 32)
    for step in range(2):
        mask = AttentionMask("block_diffusion", block_size=4, doc_ids_BL=doc_ids_BL(2, 16, step), num_outputs=16)
        model(tokens, positions, mask).hidden_BLE.sum().backward()
        assert builds[step:] == [mask]  # the last layer's x_t-only plan is a view of the full one
    assert len(builds) == 2


def test_split_stacks_the_query_heads_of_a_key_value_head():
    """Calls over both halves stack the G = H / K query heads of each key/value head along the rows
    (one call reads each key once for G heads; the CPU kernel's larger query tile); `put_rows` inverts
    `query_rows`. Noisy-only calls stay views of q (stacking copies measured slower there)."""
    from dllm.attention.backends.bd_split import Plan

    seq = 16
    mask = AttentionMask("block_diffusion", block_size=4)
    q, k, _ = make_qkv(2, (6, 2), 2 * seq)
    plan = Plan.of(mask, q, k, seq, 2)
    assert plan.group == 3
    rows = plan.query_rows(q.detach(), 8, 16)
    assert rows.shape == (2, 2, 3 * 2 * 8, D)
    # stacked rows: head h = 3 * kv_head + g, then x_t[8:16] and x_0[8:16] of that head
    torch.testing.assert_close(rows[:, 1, 2 * 16 : 2 * 16 + 8], q.detach()[:, 5, 8:16])
    torch.testing.assert_close(rows[:, 1, 2 * 16 + 8 : 3 * 16], q.detach()[:, 5, seq + 8 : seq + 16])
    back = torch.zeros_like(q.detach())
    plan.put_rows(back, rows, 8, 16)
    torch.testing.assert_close(back[:, :, 8:16], q.detach()[:, :, 8:16])
    torch.testing.assert_close(back[:, :, seq + 8 :], q.detach()[:, :, seq + 8 :])
    noisy = Plan.of(mask, q[:, :, :seq], k, seq, 2)
    assert noisy.group == 1 and noisy.query_rows(q, 0, 8)._base is not None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_split_attention_other_dtypes(dtype):
    """bf16 (float32 statistics inside) and float64 against the dense reference in the same dtype."""
    seq, block = 32, 8
    mask = AttentionMask("block_diffusion", block_size=block, **extras("all", 2, seq))
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in make_qkv(2, (4, 2), 2 * seq))
    out = split_attention(q, k, v, mask, 3)
    ref = sdpa_attention(q, k, v, mask)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-10, "rtol": 1e-10}
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)
    got = torch.autograd.grad(out.float().sum(), (q, k, v))
    want = torch.autograd.grad(ref.float().sum(), (q, k, v))
    for g_out, g_ref in zip(got, want, strict=True):
        assert g_out.dtype == dtype
        torch.testing.assert_close(g_out, g_ref, **tol)


@pytest.mark.parametrize("layout", ["row_major", "standard"])
@pytest.mark.parametrize("q_rows", ["all", "noisy"])
def test_split_attention_any_input_layout_and_expanded_gradient(layout, q_rows):
    """q/k/v laid out [B, L, H, D] (the model's projections) or [B, H, L, D], and the stride-0 gradient
    of a plain sum: outputs and gradients equal the dense reference's."""
    seq, block = 32, 8
    mask = AttentionMask("block_diffusion", block_size=block, **extras("all", 2, seq))
    base = make_qkv(2, (4, 2), 2 * seq, seed=3)
    if layout == "row_major":
        base = [t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_(True) for t in base]
    q, k, v = base
    q_in = q if q_rows == "all" else q[:, :, :seq]
    out = split_attention(q_in, k, v, mask, 3)
    ref = sdpa_attention(q_in, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad(out.sum(), (q, k, v))  # SumBackward hands over an expanded (stride 0) gradient
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    for g_out, g_ref in zip(got, want, strict=True):
        torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kind", "block", "extra"),
    [
        ("block_diffusion", 8, "all"),
        ("block_diffusion", 1, "docs"),
        ("block_causal", 4, "pad"),
        ("block_causal", 1, "all"),
    ],
)
def test_every_allowed_pair_lies_in_exactly_its_query_chunk(kind, block, extra):
    """Exactness by construction: each query row's chunk holds all the keys the dense mask allows it."""
    seq = 32
    mask = AttentionMask(kind, block_size=block, **extras(extra, 2, seq))
    S = 2 * seq if kind == "block_diffusion" else seq
    dense_B1SS = dense_mask(mask_mod(mask, S), 2, S, S, CPU)
    chunks = chunk_plan(mask, S, S, 3)
    queries = span_indices(sum((c.query_spans for c in chunks), ()), CPU)
    assert torch.equal(queries.sort().values, torch.arange(S)), "query spans partition the sequence"
    for chunk in chunks:
        q, kv = span_indices(chunk.query_spans, CPU), span_indices(chunk.key_spans, CPU)
        assert torch.equal(dense_B1SS[:, :, q][..., kv].sum(-1), dense_B1SS[:, :, q].sum(-1))


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"kind": "causal"},
        {"doc_ids_BL": doc_ids_BL(2, 16, 0)},
        {"window": 3},
        {"key_valid_BL": key_valid_BL(2, 16)},
        {"kind": "causal", "doc_ids_BL": doc_ids_BL(2, 16, 0)},
        {"kind": "causal", "window": 3, "key_valid_BL": key_valid_BL(2, 16)},
    ],
    ids=["bidirectional", "causal", "bidirectional_docs", "bidirectional_window", "bidirectional_pad", "causal_docs",
         "causal_window_pad"],
)  # fmt: skip
def test_other_kinds_are_the_sdpa_reference(fields):
    """Outputs and gradients bit for bit: what `auto` computes for these masks on CPU."""
    mask = AttentionMask(**fields)
    assert chunk_plan(mask, 16, 16, 4) is None
    q, k, v = make_qkv(2, (4, 2), 16)
    out, ref = blockwise_attention(q, k, v, mask), sdpa_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    grads_out, grads_ref = (torch.autograd.grad(o.sum(), (q, k, v)) for o in (out, ref))
    for got, want in zip(grads_out, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_chunk_masks_built_once_per_description_and_registered():
    assert make_attention("blockwise", flex_compile=True) is blockwise_attention
    mask = AttentionMask("block_diffusion", block_size=4, doc_ids_BL=doc_ids_BL(2, 32, 0))
    q, k, v = (t.detach() for t in make_qkv(2, (4, 2), 64))
    first = blockwise_attention(q, k, v, mask)
    for _ in range(2):  # more layers of one forward
        torch.testing.assert_close(blockwise_attention(q, k, v, mask), first, atol=0, rtol=0)
    assert [key[0] for key in mask.cache] == ["bd_split"]  # the CPU path's plan
    for _ in range(2):
        chunked_attention(q, k, v, mask)
    assert [key[0] for key in mask.cache] == ["bd_split", "blockwise"]


def test_bad_chunk_count_and_odd_length_raise():
    q, k, v = (t.detach() for t in make_qkv(1, (2, 2), 16))
    with pytest.raises(ValueError, match="num_chunks >= 1"):
        blockwise_attention(q, k, v, AttentionMask("block_causal", block_size=4), num_chunks=0)
    with pytest.raises(ValueError, match="even length"):
        blockwise_attention(q[:, :, :15], k[:, :, :15], v[:, :, :15], AttentionMask("block_diffusion", block_size=2))


def test_choose_backend_sends_cpu_block_masks_to_blockwise():
    for kind in ("block_causal", "block_diffusion"):
        mask = AttentionMask(kind, block_size=4)
        for flex_compile in (False, True):
            assert choose_backend(mask, "cpu", flex_compile=flex_compile) == "blockwise"
        assert choose_backend(mask, "cuda", flex_compile=True) == "flex"
    # other structured masks too: blockwise hands them to the dense SDPA reference itself
    assert choose_backend(AttentionMask("causal", doc_ids_BL=doc_ids_BL(1, 8, 0)), "cpu", True) == "blockwise"


def test_auto_calls_blockwise_for_block_diffusion_on_cpu(monkeypatch):
    calls = []
    real = blockwise_module.blockwise_attention
    monkeypatch.setattr(blockwise_module, "blockwise_attention", lambda *a: calls.append(a[3]) or real(*a))
    mask = AttentionMask("block_diffusion", block_size=4, doc_ids_BL=doc_ids_BL(2, 32, 0))
    q, k, v = make_qkv(2, (4, 2), 64)
    auto = make_attention("auto", flex_compile=True)  # on CPU flex is never compiled: blockwise takes it
    out = auto(q, k, v, mask)
    assert calls == [mask]
    torch.testing.assert_close(out, sdpa_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    with torch.no_grad():  # sampling / evaluation: blockwise as well (faster than compiled flex on CPU)
        auto(q, k, v, mask)
    assert len(calls) == 2
