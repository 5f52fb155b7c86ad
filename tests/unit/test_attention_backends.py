"""Every mask kind on every attention backend against a dense loop reference.

Covers: bidirectional, causal, block_causal, block_diffusion (BD3LM 2L layout) and sliding windows,
each alone, with documents, with key padding and with both; `sdpa`, `flex` (built with
flex_compile=False: compiling costs ~30 s per shape on this CPU, one compiled test is marked slow),
`blockwise` and `auto`; outputs and, where the backend has a CPU backward, gradients. Also:
block-diffusion pair count and clean-half equivalence, purity of mask functions, validation errors,
backends built from options, `auto` routing and the caches.

Shapes: B batch, H query heads, K key/value heads, L sequence (the 2L layout is S = 2L), D head width.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch

import dllm.attention.backends.flex as flex_module
from dllm.attention.backends import make_attention
from dllm.attention.backends.auto import AutoBackend, choose_backend, resolve_backend
from dllm.attention.backends.blockwise import blockwise_attention
from dllm.attention.backends.flex import FlexBackend, FlexCPUBackwardWarning
from dllm.attention.backends.sdpa import sdpa_attention
from dllm.attention.masks import AttentionMask, dense_mask, mask_mod
from dllm.config.registries import ATTENTION_BACKENDS

CPU = torch.device("cpu")
B, L, D = 2, 8, 8


# --------------------------------------------------------------------------------------------------
# plain references, written with loops and independently of dllm.attention.masks


def base_allowed(mask: AttentionMask, i: int, j: int, seq_len: int) -> bool:
    if mask.kind == "causal":
        return i >= j
    if mask.kind == "block_causal":
        return j // mask.block_size <= i // mask.block_size
    if mask.kind == "block_diffusion":  # [x_t ; x_0], or V noisy copies [x_t^1 ; ... ; x_t^V ; x_0]
        bi, bj = (i % seq_len) // mask.block_size, (j % seq_len) // mask.block_size
        q_noisy, kv_noisy = i < mask.views * seq_len, j < mask.views * seq_len
        if q_noisy and kv_noisy:
            return bi == bj and i // seq_len == j // seq_len  # block-diagonal, inside one copy
        if q_noisy:
            return bj < bi  # offset block-causal into x_0
        return not kv_noisy and bj <= bi  # block-causal inside x_0; clean never sees noisy
    return True


def reference_allowed(mask: AttentionMask, batch: int, q_len: int, kv_len: int) -> torch.Tensor:
    """bool [B, 1, Lq, Lk]; per-position tensors are read at position i mod L in the 2L layout."""
    seq_len = kv_len // (mask.views + 1) if mask.kind == "block_diffusion" else kv_len
    out = torch.zeros(batch, 1, q_len, kv_len, dtype=torch.bool)
    for b in range(batch):
        for i in range(q_len):
            for j in range(kv_len):
                pi, pj = i % seq_len, j % seq_len
                ok = base_allowed(mask, i, j, seq_len)
                ok = ok and (mask.window is None or abs(pi - pj) < mask.window)
                ok = ok and (mask.doc_ids_BL is None or int(mask.doc_ids_BL[b, pi]) == int(mask.doc_ids_BL[b, pj]))
                ok = ok and (mask.key_valid_BL is None or bool(mask.key_valid_BL[b, pj]))
                out[b, 0, i, j] = ok
    return out


def reference_attention(q, k, v, allowed_B1QS: torch.Tensor) -> torch.Tensor:
    """softmax(Q K^T / sqrt(D)) V under the mask; a query with no allowed key outputs zeros."""
    H, K = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
    has_key_B1Q1 = allowed_B1QS.any(-1, keepdim=True)
    allowed = allowed_B1QS | ~has_key_B1Q1  # keeps softmax finite on empty rows, zeroed below
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v) * has_key_B1Q1


def make_qkv(H: int, K: int, S: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, S, D, generator=g, requires_grad=True) for n in (H, K, K)]


# --------------------------------------------------------------------------------------------------
# cases: one sequence length L = 8 for the per-position tensors (block_diffusion runs on S = 2L = 16)

DOC_IDS = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 2, 2, 3]])
KEY_VALID = torch.tensor([[False, True, True, True, True, True, True, True], [True] * 5 + [False] * 3])
EXTRAS = {
    "alone": {},
    "documents": {"doc_ids_BL": DOC_IDS},
    "padding": {"key_valid_BL": KEY_VALID},
    "documents_padding": {"doc_ids_BL": DOC_IDS, "key_valid_BL": KEY_VALID},
}
PATTERNS = {
    "bidirectional": {},
    "causal": {"kind": "causal"},
    "block_causal": {"kind": "block_causal", "block_size": 3},  # 8 = 3 + 3 + 2: a partial last block
    "block_diffusion": {"kind": "block_diffusion", "block_size": 2},
    "bidirectional_window": {"window": 2},
    "causal_window": {"kind": "causal", "window": 3},
    "block_diffusion_window": {"kind": "block_diffusion", "block_size": 4, "window": 3},
    "block_diffusion_views": {"kind": "block_diffusion", "block_size": 2, "views": 2},  # two copies share x_0
}


def make_mask(pattern: str, extra: str) -> AttentionMask:
    return AttentionMask(**PATTERNS[pattern], **EXTRAS[extra])


def seq_len_of(mask: AttentionMask) -> int:
    return (mask.views + 1) * L if mask.kind == "block_diffusion" else L


# --------------------------------------------------------------------------------------------------
# every backend vs the reference


def assert_matches_reference(attend, mask: AttentionMask, heads: tuple[int, int], grads: bool) -> None:
    S = seq_len_of(mask)
    q, k, v = make_qkv(*heads, S)
    ref = reference_attention(q, k, v, reference_allowed(mask, B, S, S))
    with torch.no_grad():  # the sampling path: flex runs here on CPU
        torch.testing.assert_close(attend(q, k, v, mask), ref.detach(), atol=1e-5, rtol=1e-5)
    if not grads:
        return
    out = attend(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g_out, g_ref, which in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g_out, g_ref, atol=1e-5, rtol=1e-5, msg=f"grad {which}")


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)], ids=["mha", "gqa"])
@pytest.mark.parametrize("extra", sorted(EXTRAS))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("backend", ["sdpa", "flex", "blockwise", "auto"])
def test_backend_matches_dense_reference(backend, pattern, extra, heads):
    """Forward on every backend; gradients where the backend has a CPU backward (flex has none)."""
    attend = make_attention(backend, flex_compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FlexCPUBackwardWarning)  # no backend reaches flex's CPU fallback here
        assert_matches_reference(attend, make_mask(pattern, extra), heads, grads=backend != "flex")


def test_backends_are_built_from_options():
    """The registry holds factories; flex_compile reaches FlexAttention as an argument (no environment)."""
    assert set(ATTENTION_BACKENDS.names()) == {"sdpa", "flex", "blockwise", "auto"}
    for flex_compile in (False, True):
        flex, auto = make_attention("flex", flex_compile), make_attention("auto", flex_compile)
        assert isinstance(flex, FlexBackend) and flex.compiled is flex_compile and flex.compile_error is None
        assert isinstance(auto, AutoBackend) and auto.flex_compile is flex_compile
        cuda = auto.for_device("cuda")  # built once per device type (cpu and cuda with the backend)
        assert isinstance(cuda, FlexBackend) if flex_compile else cuda is sdpa_attention
        assert auto.for_device("cuda") is cuda and auto.for_device("cpu") is blockwise_attention
    assert make_attention("flex", True) is not make_attention("flex", True)  # each its own state
    with pytest.raises(KeyError, match="unknown attention backend 'dense'"):
        make_attention("dense", flex_compile=True)


def test_model_config_flex_compile_reaches_every_layer():
    from dllm.config.model import ModelConfig
    from dllm.models.transformer import Transformer

    for flex_compile in (False, True):
        cfg = ModelConfig(preset="tiny", vocab_size=64, attention_backend="flex", flex_compile=flex_compile)
        attends = [layer.self_attn.attend for layer in Transformer(cfg).layers]
        assert all(isinstance(a, FlexBackend) and a.compiled is flex_compile for a in attends)
    assert ModelConfig().flex_compile is True


def test_failed_compile_is_remembered_by_the_backend_object(monkeypatch):
    """A compile failure warns once, and that backend then runs eagerly; nothing is process-wide."""
    attempts = []

    def failing_compile():
        def kernel(*args, **kwargs):
            attempts.append(1)
            raise torch._dynamo.exc.TorchDynamoException("no C++ compiler")

        return kernel

    monkeypatch.setattr(flex_module, "compiled_flex", failing_compile)
    mask = make_mask("block_diffusion", "documents")
    q, k, v = (t.detach() for t in make_qkv(4, 2, 2 * L))
    ref = sdpa_attention(q, k, v, mask)
    flex = FlexBackend(compiled=True)
    with pytest.warns(UserWarning, match="compiling FlexAttention failed"):
        torch.testing.assert_close(flex(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)
    assert flex.compile_error is not None and "no C++ compiler" in flex.compile_error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(flex(q, k, v, mask), ref, atol=1e-5, rtol=1e-5)  # eager, no new attempt
    assert len(attempts) == 1
    other = FlexBackend(compiled=True)
    with pytest.warns(UserWarning, match="compiling FlexAttention failed"):
        other(q, k, v, mask)
    assert len(attempts) == 2 and FlexBackend(compiled=False).compile_error is None


@pytest.mark.slow
def test_compiled_flex_matches_sdpa_block_diffusion():
    """The compiled kernel (the default fast path), and flex inside a compiled model, against SDPA.

    2L = 256 (two 128 tiles). Inside a compiled region q/k/v are views of a projection (as in the
    model), the case the CPU lowering needs `.contiguous()` for.
    """
    seq, H, K = 128, 4, 2
    doc_ids = torch.arange(seq).div(48, rounding_mode="floor").expand(B, seq)
    mask = AttentionMask("block_diffusion", doc_ids_BL=doc_ids, block_size=16)
    proj = [torch.nn.Linear(16, n * D) for n in (H, K, K)]
    x = torch.randn(B, 2 * seq, 16, generator=torch.Generator().manual_seed(0))

    def attend_projected(x_BSE, attend):  # as in the model: q, k, v are transposed views of projections
        q, k, v = (p(x_BSE).view(B, 2 * seq, -1, D).transpose(1, 2) for p in proj)
        return attend(q, k, v, mask)

    flex = FlexBackend(compiled=True)
    with torch.no_grad():
        ref = attend_projected(x, sdpa_attention)
        kernel = attend_projected(x, flex)
        in_graph = torch.compile(attend_projected)(x, flex)
    assert flex.compile_error is None, flex.compile_error
    torch.testing.assert_close(kernel, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(in_graph, ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# block diffusion: structure


@pytest.mark.parametrize(("seq", "block"), [(8, 1), (8, 2), (8, 8), (12, 3), (16, 4)])
def test_block_diffusion_allows_L_squared_plus_L_times_B_pairs(seq, block):
    dense = dense_mask(mask_mod(AttentionMask("block_diffusion", block_size=block), 2 * seq), 1, 2 * seq, 2 * seq, CPU)
    assert int(dense.sum()) == seq * seq + seq * block
    assert not bool(dense[0, 0, seq:, :seq].any()), "clean queries must never see noisy keys"
    assert torch.equal(
        dense[0, 0], reference_allowed(AttentionMask("block_diffusion", block_size=block), 1, *2 * [2 * seq])[0, 0]
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("extra", sorted(EXTRAS))
@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_block_diffusion_clean_half_equals_block_causal(backend, extra, heads):
    """With x_t == x_0, the x_0 half of the 2L pass is a block-causal pass over x_0 (BD3LM's design)."""
    attend = make_attention(backend, flex_compile=False)
    q, k, v = (t.detach() for t in make_qkv(*heads, L))
    q2, k2, v2 = (torch.cat([t, t], dim=2) for t in (q, k, v))
    bd = AttentionMask("block_diffusion", block_size=4, **EXTRAS[extra])
    bc = AttentionMask("block_causal", block_size=4, **EXTRAS[extra])
    with torch.no_grad():
        torch.testing.assert_close(attend(q2, k2, v2, bd)[:, :, L:], attend(q, k, v, bc), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------
# mask descriptions and functions


@pytest.mark.parametrize("extra", sorted(EXTRAS))
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_mask_functions_are_pure(pattern, extra):
    mask = make_mask(pattern, extra)
    before = {n: t.clone() for n, t in EXTRAS[extra].items()}
    S = seq_len_of(mask)
    first = dense_mask(mask_mod(mask, S), B, S, S, CPU).clone()
    again = dense_mask(mask_mod(mask, S), B, S, S, CPU)
    assert torch.equal(first, again) and torch.equal(first, reference_allowed(mask, B, S, S))
    for name, t in before.items():
        assert torch.equal(getattr(mask, name), t), f"{name} changed"


def test_is_plain_only_for_unrestricted_bidirectional_and_causal():
    assert AttentionMask().is_plain and AttentionMask("causal").is_plain
    assert not AttentionMask(window=4).is_plain
    assert not AttentionMask("block_causal", block_size=2).is_plain
    assert not AttentionMask("block_diffusion", block_size=2).is_plain
    assert not AttentionMask(doc_ids_BL=DOC_IDS).is_plain


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kind": "block_diffusion"}, "needs block_size"),
        ({"kind": "block_causal", "block_size": 0}, "needs block_size"),
        ({"kind": "causal", "block_size": 4}, "no effect"),
        ({"window": 0}, "window must be >= 1"),
        ({"doc_ids_BL": torch.zeros(8, dtype=torch.long)}, r"\[batch, length\]"),
        ({"key_valid_BL": torch.ones(2, 8, dtype=torch.long)}, "must be bool"),
        ({"key_valid_BL": KEY_VALID, "doc_ids_BL": DOC_IDS[:, :6]}, "differ"),
    ],
)
def test_bad_descriptions_raise(fields, match):
    with pytest.raises(ValueError, match=match):
        AttentionMask(**fields)


@pytest.mark.parametrize(
    ("mask", "kv_len", "match"),
    [
        (AttentionMask("block_diffusion", block_size=2), None, "even length"),
        (AttentionMask("block_diffusion", block_size=2), 15, "even length"),
        (AttentionMask("block_diffusion", block_size=4), 12, "not a multiple of block_size"),
        (AttentionMask("block_diffusion", block_size=2, doc_ids_BL=DOC_IDS), 2 * 6, "expected 6"),
        (AttentionMask("causal", key_valid_BL=KEY_VALID), 6, "expected 6"),
    ],
)
def test_bad_lengths_raise(mask, kv_len, match):
    with pytest.raises(ValueError, match=match):
        mask_mod(mask, kv_len)


@pytest.mark.parametrize("backend", ["sdpa", "flex", "auto"])
def test_backends_reject_odd_block_diffusion_length(backend):
    q, k, v = (t.detach() for t in make_qkv(2, 2, 15))
    with pytest.raises(ValueError, match="even length"):
        make_attention(backend, flex_compile=False)(q, k, v, AttentionMask("block_diffusion", block_size=2))


# --------------------------------------------------------------------------------------------------
# auto routing and flex on CPU with gradients


def test_resolve_backend_names_what_auto_stands_for():
    for flex_compile in (False, True):
        assert resolve_backend("auto", "cpu", flex_compile) == "blockwise"
        assert resolve_backend("auto", "cuda", flex_compile) == ("flex" if flex_compile else "sdpa")
        assert resolve_backend("auto", "mps", flex_compile) == "sdpa"
        for name in ("sdpa", "flex", "blockwise"):  # explicit names pass through
            for device in ("cpu", "cuda", "mps"):
                assert resolve_backend(name, device, flex_compile) == name


def test_choose_backend_table():
    plain = [AttentionMask(), AttentionMask("causal")]
    structured = [
        AttentionMask("block_diffusion", block_size=2),
        AttentionMask(window=2),
        make_mask("causal", "padding"),
    ]
    for compiled in (False, True):
        for device in ("cpu", "cuda", "mps"):
            assert all(choose_backend(m, device, compiled) == "sdpa" for m in plain)  # mask-free SDPA everywhere
            # structured: the resolved backend (CPU: blockwise, exact and no compile; CUDA: flex when it is
            # compiled, eager flex is slow; elsewhere SDPA)
            assert all(
                choose_backend(m, device, compiled) == resolve_backend("auto", device, compiled) for m in structured
            )


@pytest.mark.parametrize("flex_compile", [False, True])
@pytest.mark.parametrize(
    ("pattern", "extra"),
    [("bidirectional", "alone"), ("causal", "alone"), ("block_causal", "documents"), ("block_diffusion", "alone"),
     ("block_diffusion", "documents_padding"), ("causal_window", "documents"), ("bidirectional", "padding")],
)  # fmt: skip
def test_auto_computes_what_its_resolved_backend_computes(pattern, extra, flex_compile):
    """A run recording `resolve_backend("auto", ...)` instead of `auto` gets the same outputs and
    gradients, bit for bit, for plain, block and other structured masks (sampling and training)."""
    auto = make_attention("auto", flex_compile)
    concrete = make_attention(resolve_backend("auto", "cpu", flex_compile), flex_compile)
    S = seq_len_of(make_mask(pattern, extra))
    for grad in (False, True):
        q, k, v = make_qkv(4, 2, S)
        with torch.set_grad_enabled(grad):
            outs = [attend(q, k, v, make_mask(pattern, extra)) for attend in (auto, concrete)]
        torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
        if grad:
            w = torch.randn(outs[0].shape, generator=torch.Generator().manual_seed(1))
            want, got = (torch.autograd.grad((out * w).sum(), (q, k, v)) for out in outs)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("kind", ["bidirectional", "causal"])
@pytest.mark.parametrize("backend", ["flex", "blockwise"])
def test_concrete_backends_take_the_mask_free_path_for_plain_masks(backend, kind, monkeypatch):
    """As `auto` does: no mask tensor or BlockMask is built, nothing is compiled, flex warns of nothing."""

    def no_compile():
        raise AssertionError("compiled flex for a plain mask")

    monkeypatch.setattr(flex_module, "compiled_flex", no_compile)
    mask = AttentionMask(kind)
    q, k, v = make_qkv(4, 2, L)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = make_attention(backend, flex_compile=True)(q, k, v, mask)
    ref = sdpa_attention(q, k, v, mask)
    assert len(mask.cache) == 0
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    grads_out, grads_ref = (torch.autograd.grad(o.sum(), (q, k, v)) for o in (out, ref))
    for a, b in zip(grads_out, grads_ref, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_auto_never_calls_flex_on_cpu():
    def no_flex(*args):
        raise AssertionError("flex called")

    auto = AutoBackend(flex_compile=True)
    auto.flex = no_flex  # type: ignore[assignment]
    mask = make_mask("block_diffusion", "documents")
    q, k, v = make_qkv(4, 2, 2 * L)
    ref = sdpa_attention(q, k, v, mask)
    with torch.no_grad():  # sampling: blockwise, exact
        torch.testing.assert_close(auto(q, k, v, mask), ref, atol=1e-5, rtol=0)
    auto(q, k, v, mask).sum().backward()  # training: blockwise too


def test_flex_with_grad_on_cpu_warns_and_computes_with_sdpa():
    mask = make_mask("block_diffusion", "documents_padding")
    q, k, v = make_qkv(4, 2, 2 * L)
    with pytest.warns(FlexCPUBackwardWarning, match="no backward on CPU"):
        out = FlexBackend(compiled=False)(q, k, v, mask)
    ref = sdpa_attention(q, k, v, mask)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    got, want = (torch.autograd.grad(o.sum(), (q, k, v)) for o in (out, ref))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# caches


def test_block_mask_built_once_per_description_and_shape(monkeypatch):
    calls = []
    real = flex_module.create_block_mask
    monkeypatch.setattr(flex_module, "create_block_mask", lambda *a, **kw: calls.append(a[1:5]) or real(*a, **kw))
    mask = make_mask("block_diffusion", "padding")
    q, k, v = (t.detach() for t in make_qkv(4, 2, 2 * L))
    flex = FlexBackend(compiled=False)
    for _ in range(3):  # three layers of one forward
        flex(q, k, v, mask)
    assert calls == [(B, None, 2 * L, 2 * L)]
    flex(q, k[:, :, : 2 * 4], v[:, :, : 2 * 4], AttentionMask("block_diffusion", block_size=2))
    assert calls[-1] == (None, None, 2 * L, 2 * 4), "a mask without per-position tensors broadcasts over batch"
    fresh = dataclasses.replace(mask)
    flex(q, k, v, fresh)
    assert len(calls) == 3, "the cache lives on the description: a new description builds its own"


def test_sdpa_dense_mask_cached_on_description():
    mask = make_mask("causal_window", "documents")
    q, k, v = (t.detach() for t in make_qkv(4, 2, L))
    first = sdpa_attention(q, k, v, mask)
    assert len(mask.cache) == 1
    torch.testing.assert_close(sdpa_attention(q, k, v, mask), first, atol=0, rtol=0)
    assert len(mask.cache) == 1


def test_mask_cache_lives_and_dies_with_its_description():
    """Built once per key for one description; an equal or replaced description has its own cache."""
    mask = make_mask("block_diffusion", "documents")
    builds = []
    assert mask.cache.memo("key", lambda: builds.append(1) or "built") == "built"
    assert mask.cache.memo("key", lambda: builds.append(1) or "again") == "built" and builds == [1]
    assert mask.cache.built("key") == "built" and mask.cache.built("other") is None
    for other in (dataclasses.replace(mask), make_mask("block_diffusion", "documents")):
        assert other == mask and other.cache is not mask.cache and other.cache.built("key") is None
    assert "cache" not in repr(mask)


# --------------------------------------------------------------------------------------------------
# ragged cached decoding: per-row query offsets (query row r of batch row b is key index r + offset[b])


@pytest.mark.parametrize("backend", ["sdpa", "flex", "blockwise", "auto"])
@pytest.mark.parametrize(("pattern", "extra"), [("causal", "alone"), ("causal", "documents_padding"),
                                                ("causal_window", "alone"), ("block_causal", "documents")])  # fmt: skip
def test_per_row_query_offsets_match_the_loop_reference(backend, pattern, extra):
    """Q = 3 query rows at different key offsets per batch row (5 and 2, plus a common offset 0 or 1)
    against S = 8 keys, on every backend, against the loop reference evaluated at the shifted rows."""
    attend = make_attention(backend, flex_compile=False)
    Q = 3
    for common in (0, 1):
        offsets = torch.tensor([5, 2]) - common
        mask = dataclasses.replace(make_mask(pattern, extra), query_offset=common, query_offset_B=offsets)
        full = reference_allowed(dataclasses.replace(mask, query_offset=0, query_offset_B=None), B, L, L)
        allowed = torch.stack([full[b, :, offsets[b] + common : offsets[b] + common + Q] for b in range(B)])
        assert torch.equal(dense_mask(mask_mod(mask, L), B, Q, L, CPU), allowed)
        q, k, v = make_qkv(4, 2, L)
        q = q[:, :, :Q]
        ref = reference_attention(q, k, v, allowed)
        with torch.no_grad():
            torch.testing.assert_close(attend(q, k, v, mask), ref.detach(), atol=1e-5, rtol=1e-5)
    assert not mask.is_plain and choose_backend(mask, "cuda", True) == "sdpa"  # a new key length every step


def test_per_row_query_offsets_are_checked():
    with pytest.raises(ValueError, match="query_offset_B must be int64"):
        AttentionMask("causal", query_offset_B=torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="query_offset_B must be int64"):
        AttentionMask("block_diffusion", block_size=2, query_offset_B=torch.tensor([1, 2]))
