"""The native transformer (models/transformer.py) with ModelConfig presets.

Shapes: B batch, L sequence, V vocabulary, E hidden width, H heads, D head width.
"""

from __future__ import annotations

import math

import pytest
import torch

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.models.flops import Layout, train_flops_per_token
from dllm.models.transformer import Transformer, apply_rope, rope_cos_sin

V = 64


def tiny_cfg(**kw) -> ModelConfig:
    return ModelConfig(preset="tiny", vocab_size=V, **kw)


def build(cfg: ModelConfig | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
    model = Transformer(cfg or tiny_cfg())
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.to(dtype).eval()


def rand_tokens(B: int, L: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(seed))


def arange_positions(B: int, L: int) -> torch.Tensor:
    return torch.arange(L).expand(B, L)


@pytest.fixture(scope="module")
def model64() -> Transformer:
    """A float64 tiny model with a larger init so that outputs clearly depend on their inputs."""
    return build(tiny_cfg(init_std=0.2), seed=3, dtype=torch.float64)


# --------------------------------------------------------------------------------------------------
# shapes and parameters


def test_forward_shapes_and_hidden():
    model = build()
    tokens = rand_tokens(3, 7)
    pos = arange_positions(3, 7)
    logits = model(tokens, pos).logits()
    assert logits.shape == (3, 7, V) and logits.dtype == torch.float32
    hidden = model(tokens, pos, AttentionMask()).hidden_BLE
    assert hidden.shape == (3, 7, 64)
    torch.testing.assert_close(model.logits(hidden), logits, atol=0, rtol=0)
    assert bool(torch.isfinite(logits).all())


def test_forward_default_mask_is_bidirectional():
    model = build()
    tokens, pos = rand_tokens(2, 6), arange_positions(2, 6)
    torch.testing.assert_close(model(tokens, pos).logits(), model(tokens, pos, AttentionMask("bidirectional")).logits())


def test_backward_reaches_every_parameter():
    model = build(tiny_cfg(qk_norm=True, qkv_bias=True, tie_embeddings=False)).train()
    tokens, pos = rand_tokens(2, 6), arange_positions(2, 6)
    model(tokens, pos).logits().logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert bool(torch.isfinite(p.grad).all()), name
        assert float(p.grad.abs().sum()) > 0, name


def test_param_count_formula():
    cfg = tiny_cfg()
    model = Transformer(cfg)
    E, H, K, D, F_ = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.mlp_size
    per_layer = E * H * D + 2 * E * K * D + H * D * E + 3 * E * F_ + 2 * E
    expected = V * E + cfg.num_layers * per_layer + E
    assert model.num_params() == expected
    assert model.num_params(exclude_embeddings=True) == expected - V * E


def test_tied_vs_untied_head():
    tied = build(tiny_cfg(tie_embeddings=True))
    untied = build(tiny_cfg(tie_embeddings=False))
    assert tied.lm_head is None
    assert untied.lm_head is not None and untied.lm_head.weight.shape == (V, 64)
    assert untied.num_params() - tied.num_params() == V * 64
    assert "lm_head.weight" not in tied.state_dict() and "lm_head.weight" in untied.state_dict()

    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(tied.logits(hidden), hidden @ tied.embed_tokens.weight.T)
    torch.testing.assert_close(untied.logits(hidden), hidden @ untied.lm_head.weight.T)
    # the untied head is its own tensor, initialised independently of the embedding
    assert not torch.equal(untied.lm_head.weight, untied.embed_tokens.weight)

    # with tied weights, a gradient step on the head moves the embedding
    tied.train()
    tied(rand_tokens(1, 4), arange_positions(1, 4)).logits().sum().backward()
    assert tied.embed_tokens.weight.grad is not None


def test_qk_norm_and_qkv_bias_parameters():
    base = set(dict(Transformer(tiny_cfg()).named_parameters()))
    qk = dict(Transformer(tiny_cfg(qk_norm=True)).named_parameters())
    bias = dict(Transformer(tiny_cfg(qkv_bias=True)).named_parameters())
    D = tiny_cfg().dim_per_head
    qk_extra = set(qk) - base
    assert qk_extra == {f"layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"}
    assert all(qk[n].shape == (D,) for n in qk_extra)
    bias_extra = set(bias) - base
    assert bias_extra == {f"layers.{i}.self_attn.{n}_proj.bias" for i in range(2) for n in "qkv"}
    assert bias["layers.0.self_attn.q_proj.bias"].shape == (4 * D,)
    assert bias["layers.0.self_attn.k_proj.bias"].shape == (2 * D,)
    assert bias["layers.0.self_attn.v_proj.bias"].shape == (2 * D,)
    assert "layers.0.self_attn.o_proj.bias" not in bias

    for cfg in (tiny_cfg(qk_norm=True), tiny_cfg(qkv_bias=True), tiny_cfg(qk_norm=True, qkv_bias=True)):
        m = build(cfg)
        out = m(rand_tokens(2, 5), arange_positions(2, 5)).logits()
        assert out.shape == (2, 5, V) and bool(torch.isfinite(out).all())


def test_qkv_bias_changes_output():
    m = build(tiny_cfg(qkv_bias=True))
    tokens, pos = rand_tokens(1, 6), arange_positions(1, 6)
    before = m(tokens, pos).logits()
    with torch.no_grad():
        m.layers[0].self_attn.v_proj.bias.fill_(0.5)
    assert not torch.allclose(before, m(tokens, pos).logits())


def test_config_shape_rules():
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(hidden_size=66, num_heads=4, vocab_size=V)
    with pytest.raises(ValueError, match="multiple"):
        ModelConfig(hidden_size=64, num_heads=4, num_kv_heads=3, vocab_size=V)
    with pytest.raises(ValueError, match="even"):
        ModelConfig(hidden_size=64, num_heads=4, head_dim=5, vocab_size=V)
    cfg = ModelConfig(hidden_size=64, num_heads=4, head_dim=8, vocab_size=V, num_layers=1)
    m = build(cfg)
    assert m.layers[0].self_attn.q_proj.weight.shape == (32, 64)
    assert m(rand_tokens(1, 3), arange_positions(1, 3)).logits().shape == (1, 3, V)


def test_preset_fills_unset_fields_only():
    cfg = ModelConfig(preset="tiny", vocab_size=V, num_layers=3)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.kv_heads) == (64, 3, 4, 2)


# --------------------------------------------------------------------------------------------------
# initialisation


def test_init_weights_deterministic_and_seed_dependent():
    a, b, c = build(seed=7), build(seed=7), build(seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys() == sc.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name
    random_params = [n for n in sa if not n.endswith("norm.weight")]
    assert random_params
    for name in random_params:
        assert not torch.equal(sa[name], sc[name]), name


def test_init_weights_overwrites_everything():
    """init_weights is the whole init: the default torch init leaves no trace."""
    m1 = Transformer(tiny_cfg(qkv_bias=True, qk_norm=True))
    m2 = Transformer(tiny_cfg(qkv_bias=True, qk_norm=True))
    with torch.no_grad():
        for p in m2.parameters():
            p.fill_(123.0)
    for m in (m1, m2):
        m.init_weights(torch.Generator().manual_seed(0))
    for (n, p1), (_, p2) in zip(m1.named_parameters(), m2.named_parameters(), strict=True):
        assert torch.equal(p1, p2), n


def test_init_std_per_parameter_kind():
    cfg = tiny_cfg(qkv_bias=True, qk_norm=True, tie_embeddings=False, init_std=0.05)
    m = build(cfg).requires_grad_(False)
    std, out_std = 0.05, 0.05 / math.sqrt(2 * cfg.num_layers)
    for name, p in m.named_parameters():
        if name.endswith("norm.weight"):
            assert bool((p == 1).all()), name
        elif name.endswith(".bias"):
            assert bool((p == 0).all()), name
        else:
            expect = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            assert float(p.std()) == pytest.approx(expect, rel=0.1), name
            assert abs(float(p.mean())) < 0.1 * expect, name
    assert out_std < std


# --------------------------------------------------------------------------------------------------
# attention pattern, padding, positions


def test_bidirectional_later_token_changes_earlier_logits(model64):
    tokens, pos = rand_tokens(1, 8), arange_positions(1, 8)
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % V
    a, b = model64(tokens, pos).logits(), model64(changed, pos).logits()
    for i in range(7):
        assert (a[0, i] - b[0, i]).abs().max() > 1e-6, i


def test_causal_mask_later_token_does_not_change_earlier_logits(model64):
    tokens, pos = rand_tokens(1, 8), arange_positions(1, 8)
    changed = tokens.clone()
    changed[0, 5] = (tokens[0, 5] + 1) % V
    mask = AttentionMask("causal")
    a, b = model64(tokens, pos, mask).logits(), model64(changed, pos, mask).logits()
    torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-12, rtol=0)
    assert (a[0, 5:] - b[0, 5:]).abs().max() > 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_left_padding_masked_keys_reproduce_unpadded_logits(dtype):
    model = build(tiny_cfg(init_std=0.1), seed=1, dtype=dtype)
    n, pad = 6, 3
    real = rand_tokens(1, n, seed=5)
    ref = model(real, arange_positions(1, n)).logits()

    # row 0: three arbitrary pad tokens then the sequence; row 1: another real sequence
    other = rand_tokens(1, n + pad, seed=6)
    pad_tokens = torch.tensor([[17, 3, 60]])
    tokens = torch.cat([torch.cat([pad_tokens, real], 1), other], 0)
    valid = torch.ones(2, n + pad, dtype=torch.bool)
    valid[0, :pad] = False
    positions = (valid.long().cumsum(-1) - 1).clamp_min(0)
    out = model(tokens, positions, AttentionMask("bidirectional", key_valid_BL=valid)).logits()
    torch.testing.assert_close(out[0:1, pad:], ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1:2], model(other, arange_positions(1, n + pad)).logits(), atol=1e-5, rtol=1e-5)

    # the pad tokens themselves are irrelevant
    tokens2 = tokens.clone()
    tokens2[0, :pad] = torch.tensor([1, 2, 4])
    out2 = model(tokens2, positions, AttentionMask("bidirectional", key_valid_BL=valid)).logits()
    torch.testing.assert_close(out2[0, pad:], out[0, pad:], atol=1e-5, rtol=1e-5)


def test_document_mask_equals_separate_documents(model64):
    a, b = rand_tokens(1, 5, seed=1), rand_tokens(1, 3, seed=2)
    tokens = torch.cat([a, b], 1)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    docs = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1]])
    out = model64(tokens, positions, AttentionMask("bidirectional", doc_ids_BL=docs)).logits()
    torch.testing.assert_close(out[:, :5], model64(a, arange_positions(1, 5)).logits(), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out[:, 5:], model64(b, arange_positions(1, 3)).logits(), atol=1e-10, rtol=1e-10)


def test_rope_scores_depend_only_on_position_difference():
    cfg = tiny_cfg()
    m = Transformer(cfg)
    D = cfg.dim_per_head
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, D, generator=g)
    k = torch.randn(1, 1, 1, D, generator=g)

    def score(m_pos: int, n_pos: int) -> float:
        cq, sq = rope_cos_sin(torch.tensor([[m_pos]]), m.inv_freq)
        ck, sk = rope_cos_sin(torch.tensor([[n_pos]]), m.inv_freq)
        return float((apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum())

    for dm, dn in [(3, 1), (0, 5), (7, 7), (10, 2)]:
        base = score(dm, dn)
        for shift in (1, 4, 13, 100):
            assert score(dm + shift, dn + shift) == pytest.approx(base, abs=1e-4)
    # and they do depend on the difference
    assert abs(score(5, 0) - score(0, 0)) > 1e-3
    # position 0 is the identity; rotation preserves the norm
    c0, s0 = rope_cos_sin(torch.zeros(1, 1, dtype=torch.long), m.inv_freq)
    torch.testing.assert_close(apply_rope(q, c0, s0), q)
    c9, s9 = rope_cos_sin(torch.full((1, 1), 9), m.inv_freq)
    torch.testing.assert_close(apply_rope(q, c9, s9).norm(), q.norm())


def test_rope_cos_sin_shapes_and_inv_freq():
    cfg = tiny_cfg(rope_theta=500.0)
    m = Transformer(cfg)
    D = cfg.dim_per_head
    assert m.inv_freq.shape == (D // 2,)
    torch.testing.assert_close(m.inv_freq, 500.0 ** (-torch.arange(0, D, 2).float() / D))
    cos, sin = rope_cos_sin(arange_positions(3, 5), m.inv_freq)
    assert cos.shape == sin.shape == (3, 1, 5, D)
    torch.testing.assert_close(cos**2 + sin**2, torch.ones_like(cos))


def test_outputs_depend_on_positions_but_not_on_their_offset(model64):
    tokens = rand_tokens(1, 8)
    pos = arange_positions(1, 8)
    base = model64(tokens, pos).logits()
    # relative positions are all that matters: a global shift changes nothing (up to the float32
    # cos/sin that RoPE uses whatever the model dtype)
    torch.testing.assert_close(model64(tokens, pos + 11).logits(), base, atol=1e-5, rtol=1e-5)
    # different relative positions change the output
    assert (model64(tokens, pos * 2).logits() - base).abs().max() > 1e-4
    assert (model64(tokens, pos.flip(-1)).logits() - base).abs().max() > 1e-4


def test_positions_are_per_row():
    model = build(tiny_cfg(init_std=0.1), dtype=torch.float64)
    tokens = rand_tokens(2, 6)
    pos = torch.stack([torch.arange(6), torch.arange(6) * 3])
    both = model(tokens, pos).logits()
    torch.testing.assert_close(both[0:1], model(tokens[0:1], pos[0:1]).logits())
    torch.testing.assert_close(both[1:2], model(tokens[1:2], pos[1:2]).logits())


# --------------------------------------------------------------------------------------------------
# meta device, flops


@pytest.mark.parametrize("variant", [{}, {"tie_embeddings": False, "qk_norm": True, "qkv_bias": True}])
def test_meta_construction_then_load_reproduces_model(variant):
    cfg = tiny_cfg(**variant)
    ref = build(cfg, seed=4)
    with torch.device("meta"):
        meta = Transformer(cfg)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device=torch.device("cpu"))
    meta.init_buffers()
    meta.load_state_dict(ref.state_dict())
    meta.eval()
    torch.testing.assert_close(meta.inv_freq, ref.inv_freq, atol=0, rtol=0)
    tokens, pos = rand_tokens(2, 6), arange_positions(2, 6)
    torch.testing.assert_close(meta(tokens, pos).logits(), ref(tokens, pos).logits(), atol=0, rtol=0)
    if cfg.tie_embeddings:
        assert meta.lm_head is None


def test_meta_construction_then_init_weights_matches_normal_init():
    cfg = tiny_cfg()
    ref = build(cfg, seed=9)
    with torch.device("meta"):
        meta = Transformer(cfg)
    meta.to_empty(device=torch.device("cpu"))
    meta.init_weights(torch.Generator().manual_seed(9))
    for (n, a), (_, b) in zip(ref.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    torch.testing.assert_close(meta.inv_freq, ref.inv_freq, atol=0, rtol=0)


def test_train_flops_per_token_positive_and_grows_with_seq_len():
    cfg = tiny_cfg()
    n = Transformer(cfg).num_params(exclude_embeddings=True)
    f = [train_flops_per_token(cfg, Layout(seq_len=L, row_len=L)) for L in (1, 32, 128, 1024)]
    assert all(x > 0 for x in f)
    assert f == sorted(f) and len(set(f)) == len(f)
    # at least 6 FLOPs per non-embedding parameter
    assert f[0] >= 6 * n
    # the attention term is linear in seq_len
    assert f[3] - f[2] == pytest.approx((f[2] - f[1]) * (1024 - 128) / (128 - 32))
    # a bigger model costs more
    big = ModelConfig(preset="demo", vocab_size=V)
    assert train_flops_per_token(big, Layout(seq_len=32, row_len=32)) > f[1]


def test_train_flops_per_token_does_not_depend_on_weight_tying():
    tied, untied = tiny_cfg(tie_embeddings=True), tiny_cfg(tie_embeddings=False)
    layout = Layout(seq_len=128, row_len=128)
    # the same matmuls run whether or not the head shares the embedding's storage
    assert train_flops_per_token(untied, layout) == train_flops_per_token(tied, layout)
