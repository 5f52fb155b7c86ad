"""Nemotron-Labs-Diffusion: its public checkpoint layout in and out, and the forward against a reference
written here from NVIDIA's public code.

The reference follows Megatron-Bridge's nemotron_labs_diffusion_attention.py (RoPE with YaRN through
transformers' `ROPE_INIT_FUNCTIONS`, cos/sin times the attention factor, queries times Llama 4's
1 + beta ln(1 + floor(p / original_max_position_embeddings)), GQA by repeating k/v) inside a Ministral 3
block (pre-RMSNorm, SwiGLU), with `encoder.*` / `diffusion_head.weight` as in its bridge's weight map.
The tiny config keeps the published keys but a 16-token `original_max_position_embeddings`, so that
the positions of the test cross it and both YaRN's ramp and the query temperature matter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

V, E, NL, H, K, D, FF = 80, 32, 2, 4, 2, 8, 48
ROPE = {
    "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 16,
    "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.1,
}  # fmt: skip
CONFIG = {
    "architectures": ["NemotronLabsDiffusionModel"], "model_type": "nemotron_labs_diffusion", "vocab_size": V,
    "hidden_size": E, "num_hidden_layers": NL, "num_attention_heads": H, "num_key_value_heads": K, "head_dim": D,
    "intermediate_size": FF, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "sliding_window": None,
    "rope_parameters": ROPE, "mask_token_id": 3, "block_size": 4, "dlm_paradigm": "bidirectional",
    "ar_loss_weight": 1.0, "dlm_loss_weight": None, "torch_dtype": "float32",
}  # fmt: skip


def public_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights under the public names (the bridge's text-only map)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    sd = {"encoder.embed_tokens.weight": r(V, E), "encoder.norm.weight": 1 + r(E), "diffusion_head.weight": r(V, E)}
    for i in range(NL):
        p = f"encoder.layers.{i}."
        sd |= {p + "input_layernorm.weight": 1 + r(E), p + "post_attention_layernorm.weight": 1 + r(E),
               p + "self_attn.q_proj.weight": r(H * D, E), p + "self_attn.k_proj.weight": r(K * D, E),
               p + "self_attn.v_proj.weight": r(K * D, E), p + "self_attn.o_proj.weight": r(E, H * D),
               p + "mlp.gate_proj.weight": r(FF, E), p + "mlp.up_proj.weight": r(FF, E),
               p + "mlp.down_proj.weight": r(E, FF)}  # fmt: skip
    return sd


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("nemotron") / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(CONFIG))
    safetensors_torch.save_file(public_weights(), str(path / "model.safetensors"))
    return path


def load(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder)
    model = Transformer(cfg.model_copy(update={"attention_backend": "sdpa"}))
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


# -- the reference ----------------------------------------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([-x[..., D // 2 :], x[..., : D // 2]], dim=-1)


def _cos_sin(positions_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bridge's Ministral3RotaryEmbedding: transformers' YaRN init, cos/sin times its attention factor."""
    cfg = transformers.PretrainedConfig(hidden_size=E, num_attention_heads=H, head_dim=D, max_position_embeddings=64)
    cfg.rope_parameters = {k: v for k, v in ROPE.items() if k != "llama_4_scaling_beta"}
    cfg.standardize_rope_params = lambda: None  # the parameters above are already standard
    inv_freq, factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    freqs = positions_BL[..., None].float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos()[:, None] * factor, emb.sin()[:, None] * factor


def reference_forward(sd: dict[str, torch.Tensor], tokens_BL, positions_BL, allowed_LL) -> torch.Tensor:
    """Logits [B, L, V] of the public model under a bool mask `allowed_LL` (query, key)."""
    B, L = tokens_BL.shape
    cos, sin = _cos_sin(positions_BL)
    scale = 1 + ROPE["llama_4_scaling_beta"] * torch.log(1 + torch.floor(positions_BL.float() / 16))
    x = sd["encoder.embed_tokens.weight"][tokens_BL]
    for i in range(NL):
        p = f"encoder.layers.{i}."
        h = _rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(B, L, H, D).transpose(1, 2)
        k = (h @ sd[p + "self_attn.k_proj.weight"].T).view(B, L, K, D).transpose(1, 2)
        v = (h @ sd[p + "self_attn.v_proj.weight"].T).view(B, L, K, D).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q = q * scale[:, None, :, None]
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        attn = scores.masked_fill(~allowed_LL, float("-inf")).softmax(-1) @ v
        x = x + attn.transpose(1, 2).reshape(B, L, H * D) @ sd[p + "self_attn.o_proj.weight"].T
        h = _rms(x, sd[p + "post_attention_layernorm.weight"])
        gated = F.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + gated @ sd[p + "mlp.down_proj.weight"].T
    return _rms(x, sd["encoder.norm.weight"]) @ sd["diffusion_head.weight"].T


def _inputs(L: int = 40, B: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    return tokens, torch.arange(L).expand(B, L)


# -- tests -----------------------------------------------------------------------------------------------
def test_config_import(folder: Path):
    cfg = model_config_from_hf(folder)
    assert cfg.family == "nemotron_labs_diffusion" and not cfg.tie_embeddings
    assert (cfg.num_layers, cfg.num_heads, cfg.kv_heads, cfg.dim_per_head, cfg.mlp_size) == (NL, H, K, D, FF)
    assert cfg.rope_yarn is not None and (cfg.rope_yarn.factor, cfg.rope_yarn.original_max_seq_len) == (4.0, 16)
    assert (cfg.query_scale_beta, cfg.query_scale_length, cfg.rope_theta) == (0.1, 16, 1000000.0)


@pytest.mark.parametrize("kind", ["causal", "bidirectional"])
def test_forward_matches_the_reference(folder: Path, kind: str):
    """Causal (AR mode) and bidirectional (a diffusion block) forwards, positions 0..39 across the
    16-token pretraining context: float32 logits within 1e-4 of the reference."""
    model = load(folder)
    tokens, positions = _inputs()
    L = tokens.shape[1]
    allowed = torch.ones(L, L).tril().bool() if kind == "causal" else torch.ones(L, L, dtype=torch.bool)
    with torch.no_grad():
        ours = model.logits(model(tokens, positions, AttentionMask(kind)).hidden_BLE)
        ref = reference_forward(public_weights(), tokens, positions, allowed)
    diff = (ours - ref).abs().max().item()
    assert diff <= 1e-4, diff


def test_the_reference_is_transformers_ministral3():
    """The reference agrees with transformers' Ministral3ForCausalLM (the decoder the public remote code
    builds on) on the same weights: the reference itself is checked."""
    cfg = transformers.Ministral3Config(
        vocab_size=V, hidden_size=E, intermediate_size=FF, num_hidden_layers=NL, num_attention_heads=H,
        num_key_value_heads=K, head_dim=D, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters=dict(ROPE), sliding_window=None,
    )  # fmt: skip
    model = transformers.Ministral3ForCausalLM(cfg).eval()
    renamed = {"lm_head.weight" if k == "diffusion_head.weight" else k.replace("encoder.", "model."): v
               for k, v in public_weights().items()}  # fmt: skip
    model.load_state_dict(renamed, strict=True)
    tokens, positions = _inputs()
    L = tokens.shape[1]
    with torch.no_grad():
        theirs = model(input_ids=tokens, position_ids=positions).logits
    ref = reference_forward(public_weights(), tokens, positions, torch.ones(L, L).tril().bool())
    assert (theirs - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("factor,mscale,mscale_all_dim,theta", [(4.0, 1.0, 1.0, 1e6), (16.0, 0.707, 1.0, 1e4),
                                                            (8.0, 0.0, 0.0, 5e5), (40.0, 1.0, 0.0, 1e4)])  # fmt: skip
def test_yarn_tables_are_transformers(factor: float, mscale: float, mscale_all_dim: float, theta: float):
    """Inverse frequencies and the cos/sin factor equal transformers' YaRN init (which the public
    attention calls), also where the factor is not 1."""
    from dllm.config.model import YarnRope
    from dllm.models.transformer import yarn_attention_factor, yarn_inv_freq

    params = {"rope_type": "yarn", "rope_theta": theta, "factor": factor, "original_max_position_embeddings": 64,
              "beta_fast": 32.0, "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale_all_dim}  # fmt: skip
    cfg = transformers.PretrainedConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=64)
    cfg.rope_parameters = params
    cfg.standardize_rope_params = lambda: None
    want, want_factor = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    yarn = YarnRope(factor=factor, original_max_seq_len=64, mscale=mscale, mscale_all_dim=mscale_all_dim)
    torch.testing.assert_close(yarn_inv_freq(32, theta, yarn), want, atol=0, rtol=1e-6)
    assert yarn_attention_factor(yarn) == pytest.approx(want_factor, rel=1e-12)


def test_yarn_and_query_temperature_matter(folder: Path):
    """Plain RoPE or no temperature would give other logits: the test above checks both."""
    model = load(folder)
    tokens, positions = _inputs()
    with torch.no_grad():
        base = model.logits(model(tokens, positions, AttentionMask("causal")).hidden_BLE)
        for change in ({"rope_yarn": None}, {"query_scale_beta": None, "query_scale_length": None}):
            other = Transformer(model.cfg.model_copy(update=change)).eval()
            other.load_state_dict(model.state_dict())
            changed = other.logits(other(tokens, positions, AttentionMask("causal")).hidden_BLE)
            assert (changed - base).abs().max() > 1e-3


def test_export_writes_the_public_layout_back(folder: Path, tmp_path: Path):
    model = load(folder)
    out = export_hf(model.state_dict(), model.cfg, tmp_path / "out")
    written = safetensors_torch.load_file(str(out / "model.safetensors"))
    original = public_weights()
    assert set(written) == set(original)
    assert all(torch.equal(written[k], original[k]) for k in original)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "nemotron_labs_diffusion"
    assert config["architectures"] == ["NemotronLabsDiffusionModel"]
    assert {k: config["rope_parameters"][k] for k in ROPE} == ROPE
    assert model_config_from_hf(out) == model_config_from_hf(folder)


@pytest.mark.parametrize("objective", ["nemotron_diffusion", "ar"])
def test_export_records_how_the_model_decodes(folder: Path, tmp_path: Path, objective: str):
    """config.json carries the published decode and loss keys of the run (mask_token_id, block_size, dlm_paradigm,
    the loss weights), and a folder without a decode profile decodes by them: the run's profile and config."""
    from dllm.checkpoint.loading import derive_profile
    from dllm.config.objectives import ARConfig, NemotronDiffusionConfig
    from dllm.tokenization import ByteTokenizer

    model, tok = load(folder), ByteTokenizer()
    section = NemotronDiffusionConfig(block_size=8, diffusion_weight=0.25) if objective != "ar" else ARConfig()
    profile = derive_profile(section, model.cfg, tok).model_copy(update={"mask_id": 7})
    out = export_hf(model.state_dict(), model.cfg, tmp_path / "out", profile=profile, objective=section)
    config = json.loads((out / "config.json").read_text())
    written = {k: config.get(k) for k in ("mask_token_id", "block_size", "dlm_paradigm", "dlm_loss_weight",
                                          "ar_loss_weight")}  # fmt: skip
    if objective == "ar":
        assert written == {"mask_token_id": 7, "block_size": None, "dlm_paradigm": "autoregressive",
                           "dlm_loss_weight": None, "ar_loss_weight": None}  # fmt: skip
    else:
        assert written == {"mask_token_id": 7, "block_size": 8, "dlm_paradigm": "bidirectional",
                           "dlm_loss_weight": 0.25, "ar_loss_weight": 1.0}  # fmt: skip
    assert model_config_from_hf(out) == model_config_from_hf(folder)
    back = derive_profile(None, model_config_from_hf(out), tok, out)
    assert back.model_dump(exclude={"objective"}) == profile.model_dump(exclude={"objective"})


def test_public_config_decodes_in_its_blocks(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """`dllm convert` of the public layout decodes as its config.json says (blocks of block_size with a causal
    context, mask_token_id); exported back, the keys are the same and a second import has the same profile."""
    from dllm.cli.main import main as dllm
    from dllm.config.profile import read_profile

    assert dllm(["convert", "--from-hf", str(folder), "--to", str(tmp_path / "a")]) == 0, capsys.readouterr().err
    first = read_profile(tmp_path / "a")
    assert first is not None
    assert (first.attention, first.block_size, first.causal_context, first.shift, first.mask_id) == (
        "block", CONFIG["block_size"], True, False, CONFIG["mask_token_id"])  # fmt: skip
    assert dllm(["convert", "--to-hf", str(tmp_path / "b"), "--model", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert {k: config[k] for k in ("mask_token_id", "block_size", "dlm_paradigm")} == {
        k: CONFIG[k] for k in ("mask_token_id", "block_size", "dlm_paradigm")}  # fmt: skip
    (tmp_path / "b" / "decode_profile.json").unlink()  # as another tool writes the folder: config.json alone
    assert dllm(["convert", "--from-hf", str(tmp_path / "b"), "--to", str(tmp_path / "c")]) == 0
    assert read_profile(tmp_path / "c") == first
    a, c = ((tmp_path / x / "model.yaml").read_text() for x in "ac")
    assert a == c


def test_unsupported_layouts_are_one_line_errors(folder: Path, tmp_path: Path):
    from dllm.errors import ConfigError

    for change in ({"sliding_window": 8}, {"rope_parameters": {**ROPE, "rope_type": "longrope"}}):
        bad = tmp_path / next(iter(change))
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**CONFIG, **change}))
        with pytest.raises(ConfigError):
            model_config_from_hf(bad)
    from dllm.models.hf_io import decode_facts_from_hf

    for key, value in (("block_size", 0), ("mask_token_id", "100"), ("dlm_paradigm", 3)):
        bad = tmp_path / key
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**CONFIG, key: value}))
        with pytest.raises(ConfigError, match=f"config.json: {key}: expected") as e:
            decode_facts_from_hf(bad)
        assert "\n" not in str(e.value)


# -- training: the [x_t ; x_0] forward and the joint loss --------------------------------------------------
def public_training_mask(L: int, block: int) -> torch.Tensor:
    """The sbd_block_diff mask of Megatron-Bridge's dllm.compute_block_mask, [2L, 2L] bool: x_t
    block-diagonal, x_t -> strictly earlier x_0 blocks, x_0 fully causal."""
    q, kv = torch.arange(2 * L)[:, None], torch.arange(2 * L)[None, :]
    q_clean, kv_clean = q >= L, kv >= L
    bq, bkv = torch.where(q_clean, (q - L) // block, q // block), torch.where(kv_clean, (kv - L) // block, kv // block)
    diagonal = (bq == bkv) & ~q_clean & ~kv_clean
    offset_causal = (bq > bkv) & kv_clean & ~q_clean
    causal = (q >= kv) & q_clean & kv_clean
    return diagonal | offset_causal | causal


def test_training_mask_is_the_public_one():
    from dllm.attention.masks import dense_mask, mask_mod

    L, b = 12, 4
    mask = AttentionMask("block_diffusion", block_size=b, causal_context=True)
    ours = dense_mask(mask_mod(mask, 2 * L), 1, 2 * L, 2 * L, torch.device("cpu"))[0, 0]
    assert torch.equal(ours, public_training_mask(L, b))
    bd3lm = dense_mask(mask_mod(AttentionMask("block_diffusion", block_size=b), 2 * L), 1, 2 * L, 2 * L, "cpu")
    assert not torch.equal(bd3lm[0, 0], ours)  # BD3LM's clean half is block-causal


def test_training_forward_matches_the_reference(folder: Path):
    """The doubled sequence, positions 0..L-1 per half (the RoPE restart of the public attention). The
    public training attention scales queries by their index in 2L; below original_max_position_embeddings
    / 2 (8192 tokens in the published config, 8 here) that scale is 1 as ours (by position) is."""
    model = load(folder)
    L, b = 8, 4
    x0 = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(3))
    xt = torch.where(torch.rand(2, L, generator=torch.Generator().manual_seed(4)) < 0.5, 3, x0)
    tokens, positions = torch.cat([xt, x0], 1), torch.arange(L).repeat(2).expand(2, 2 * L)
    mask = AttentionMask("block_diffusion", block_size=b, causal_context=True)
    with torch.no_grad():
        ref = reference_forward(public_weights(), tokens, positions, public_training_mask(L, b))
        for backend in ("sdpa", "blockwise"):
            m = Transformer(model.cfg.model_copy(update={"attention_backend": backend})).eval()
            m.load_state_dict(model.state_dict())
            diff = (m.logits(m(tokens, positions, mask).hidden_BLE) - ref).abs().max().item()
            assert diff <= 1e-4, (backend, diff)


@pytest.mark.parametrize("backend", ["blockwise", "flex"])
@pytest.mark.parametrize("kind", ["block_diffusion", "block_causal"])
def test_causal_context_backends_match_the_dense_mask(backend: str, kind: str):
    """Fast paths against SDPA's dense mask, forward and backward, documents included."""
    from dllm.attention.backends import make_attention

    L, b = 16, 4
    S = 2 * L if kind == "block_diffusion" else L
    docs = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    mask = AttentionMask(kind, block_size=b, doc_ids_BL=docs, causal_context=True)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4 if i == 0 else 2, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for i in range(3))  # fmt: skip
    want = make_attention("sdpa", False)(q, k, v, mask)
    with torch.no_grad():  # FlexAttention's CPU forward runs its BlockMask (its backward would fall back to SDPA)
        torch.testing.assert_close(make_attention(backend, False)(q, k, v, mask), want, atol=1e-10, rtol=0)
    if backend == "flex":
        return
    got = make_attention(backend, False)(q, k, v, mask)
    w = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for a, c in zip(torch.autograd.grad((got * w).sum(), (q, k, v)), torch.autograd.grad((want * w).sum(), (q, k, v)),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, c, atol=1e-10, rtol=0)


def _objective(**overrides):
    from dllm.config.objectives import NemotronDiffusionConfig
    from dllm.diffusion.objectives import TokenIds
    from dllm.diffusion.objectives.nemotron import NemotronDiffusionObjective

    ids = TokenIds(mask_id=3, eos_id=2, pad_id=1, num_tokens=V)
    cfg = NemotronDiffusionConfig(**{"block_size": 4, **overrides})
    return NemotronDiffusionObjective(cfg, ids, chunked_loss=False), cfg


def _batch(L: int = 12):
    from dllm.data.loader import Batch

    tokens = torch.randint(4, V, (3, L), generator=torch.Generator().manual_seed(5))
    sup = torch.ones(3, L, dtype=torch.bool)
    sup[1, :5] = False  # a prompt: neither masked nor a next-token target
    return Batch(tokens, sup, torch.tensor([10, 11, 12]))


@pytest.mark.parametrize("normalize", ["sequence", "token"])
def test_joint_loss_equals_the_hand_computation(folder: Path, normalize: str):
    """Fixed noise: the masks and ratios from the same keys, the two cross-entropies from the model's
    logits by hand (mask token out of the softmax), 0.3 * diffusion + 1.0 * next-token over the counts."""
    from dllm.diffusion.corruption import NoiseKeys

    model = load(folder)
    obj, cfg = _objective(normalize=normalize)
    batch, noise = _batch(), NoiseKeys(7, 3)
    inputs = obj.prepare(batch, noise)
    with torch.no_grad():
        out = model(inputs.tokens_BL, inputs.positions_BL, inputs.mask)
        got = obj.loss(out, inputs).loss_sum / obj.normalizer(batch)
        logits = model.logits(out.hidden_BLE).double()
    x0, sup = batch.tokens_BL, batch.loss_mask_BL
    B, L = x0.shape
    p = 1e-3 + (1 - 1e-3) * noise.uniform(batch.sample_ids_B, (), "nemotron.p").double()
    masked = (noise.uniform(batch.sample_ids_B, (L,), "nemotron.mask") < p[:, None].float()) & sup
    assert torch.equal(inputs.tokens_BL[:, :L], torch.where(masked, 3, x0))
    assert torch.equal(inputs.tokens_BL[:, L:], x0)
    logp = logits.index_fill(-1, torch.tensor([3]), float("-inf")).log_softmax(-1)
    rows = []
    for r in range(B):
        diffusion = sum(-logp[r, i, x0[r, i]] / p[r] for i in range(L) if masked[r, i])
        nxt = sum(-logp[r, L + i - 1, x0[r, i]] for i in range(1, L) if sup[r, i])
        n_terms = int(masked[r].sum()) + int(sup[r, 1:].sum())
        rows.append((0.3 * diffusion + 1.0 * nxt, n_terms))
    if normalize == "sequence":
        want = sum(s / n for s, n in rows) / B
    else:
        want = sum(s for s, _ in rows) / int(sup[:, 1:].sum())
    assert abs(float(got) - float(want)) < 1e-5, (float(got), float(want))


def test_weights_select_the_terms(folder: Path):
    """ar_weight 0 leaves the diffusion term; diffusion_weight 0 the next-token term."""
    from dllm.diffusion.corruption import NoiseKeys

    model = load(folder)
    batch = _batch()
    parts = {}
    for name, kw in (("both", {}), ("diffusion", {"ar_weight": 0.0}), ("ar", {"diffusion_weight": 0.0})):
        obj, _ = _objective(**kw)
        inputs = obj.prepare(batch, NoiseKeys(7, 3))
        with torch.no_grad():
            parts[name] = obj.loss(model(inputs.tokens_BL, inputs.positions_BL, inputs.mask), inputs)
    assert float(parts["both"].loss_sum) == pytest.approx(float(parts["diffusion"].loss_sum + parts["ar"].loss_sum))
    assert int(parts["both"].metrics["num_ar"]) == int(batch.loss_mask_BL[:, 1:].sum())


def test_a_tiny_model_learns_with_the_joint_loss():
    """30 AdamW steps on a fixed batch of a tiny nemotron_labs_diffusion model: the loss falls."""
    from dllm.config.model import ModelConfig
    from dllm.data.loader import Batch
    from dllm.diffusion.corruption import NoiseKeys

    model = Transformer(ModelConfig(family="nemotron_labs_diffusion", preset="tiny", vocab_size=V))
    model.init_weights(torch.Generator().manual_seed(0))
    obj, _ = _objective(block_size=8)
    pattern = torch.arange(32) % 7 + 4
    batch = Batch(pattern.expand(4, 32).clone(), torch.ones(4, 32, dtype=torch.bool), torch.arange(4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        inputs = obj.prepare(batch, NoiseKeys(step, 4))
        loss = obj.loss(model(inputs.tokens_BL, inputs.positions_BL, inputs.mask), inputs).loss_sum
        loss = loss / obj.normalizer(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5, losses


# -- decoding ---------------------------------------------------------------------------------------------
def _tiny_model() -> Transformer:
    from dllm.config.model import ModelConfig

    cfg = ModelConfig(family="nemotron_labs_diffusion", preset="tiny", vocab_size=V, init_std=0.2)
    model = Transformer(cfg.model_copy(update={"attention_backend": "sdpa"}))
    model.init_weights(torch.Generator().manual_seed(0))
    return model.double().eval()


def test_decoding_reads_what_training_trained():
    """A noisy block after two clean blocks: its states under the decoding mask (block_causal with a causal
    context) equal its states in the training forward's x_t half."""
    model, L, b = _tiny_model(), 12, 4
    x0 = torch.randint(4, V, (2, L), generator=torch.Generator().manual_seed(6))
    block = torch.where(torch.rand(2, b, generator=torch.Generator().manual_seed(7)) < 0.5, 3, x0[:, 8:])
    xt = torch.cat([x0[:, :8], block], 1)
    with torch.no_grad():
        train = model(torch.cat([xt, x0], 1), torch.arange(L).repeat(2).expand(2, 2 * L),
                      AttentionMask("block_diffusion", block_size=b, causal_context=True))  # fmt: skip
        decode = model(
            xt, torch.arange(L).expand(2, L), AttentionMask("block_causal", block_size=b, causal_context=True)
        )
        plain = model(xt, torch.arange(L).expand(2, L), AttentionMask("block_causal", block_size=b))
    torch.testing.assert_close(decode.hidden_BLE[:, 8:], train.hidden_BLE[:, 8:L], atol=1e-10, rtol=0)
    assert (plain.hidden_BLE[:, 8:] - train.hidden_BLE[:, 8:L]).abs().max() > 1e-6  # BD3LM's context differs


def test_the_run_decodes_with_its_blocks_and_causal_context():
    from dllm.config.objectives import NemotronDiffusionConfig
    from dllm.config.profile import build_profile
    from dllm.config.sampler import SamplerConfig, resolve_sampler

    profile = build_profile(NemotronDiffusionConfig(), shift_logits=False, max_length=4096, mask_id=3, pad_id=1,
                            eos_id=2, num_tokens=V)  # fmt: skip
    assert (profile.attention, profile.block_size, profile.shift, profile.causal_context) == ("block", 64, False, True)
    cfg = resolve_sampler(SamplerConfig(gen_length=128, steps=128), profile)
    assert (cfg.attention, cfg.block_length, cfg.shift, cfg.causal_context) == ("block", 64, "off", "on")
    # the published sampler decodes in blocks of 32: any block length reads a causal context as trained
    assert resolve_sampler(SamplerConfig(gen_length=128, steps=128, block_length=32), profile).block_length == 32
    from dllm.errors import ConfigError

    with pytest.raises(ConfigError, match="the same or shorter"):  # longer noisy blocks than trained
        resolve_sampler(SamplerConfig(gen_length=128, steps=128, block_length=128), profile)
    from types import SimpleNamespace

    from dllm.config.model import ModelConfig
    from dllm.evaluation.likelihood import scoring_for

    model_cfg = ModelConfig(family="nemotron_labs_diffusion", preset="tiny", vocab_size=V)
    how = scoring_for(SimpleNamespace(profile=profile, model_cfg=model_cfg))  # the block bound reads x_0 as trained
    assert (how.kind, how.block_size, how.shift, how.causal_context) == ("block", 64, False, True)


def test_cached_block_decoding_equals_uncached():
    from dllm.config.sampler import SamplerConfig
    from dllm.inference.engine import generate
    from dllm.sampling.canvas import SpecialIds

    model = _tiny_model()
    special = SpecialIds(mask_id=3, pad_id=1, eos_id=2, num_tokens=V)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15], [16, 17, 18, 19, 20, 21]]

    def run(cache: str, rows: list[list[int]]):
        cfg = SamplerConfig(gen_length=12, block_length=4, steps=12, stop_at_eos=False, cache=cache,
                            attention="block", causal_context="on", shift="off", policy="low_confidence")  # fmt: skip
        return generate(model, rows, cfg, special, generator=torch.Generator().manual_seed(0))

    plain, cached = run("none", prompts), run("block", prompts)
    assert cached.sequences == plain.sequences
    assert cached.counters.cached_tokens > 0
    from dllm.inference.engine import shares_forwards

    # the server's running canvas batch builds its own block-causal masks: these requests run as calls
    on = SamplerConfig(gen_length=12, block_length=4, attention="block", causal_context="on", shift="off")
    off = on.model_copy(update={"causal_context": "off"})
    assert not shares_forwards(on, model) and shares_forwards(off, model)
    for i, prompt in enumerate(prompts):  # a padded row decodes as the prompt alone
        assert run("block", [prompt]).sequences[0] == plain.sequences[i], i


# -- bad combinations: one line, exit 2 ------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """The nemotron-diffusion-smoke recipe, copied and prepared (the config checks read the artifact)."""
    from dllm.cli.main import main

    path = tmp_path_factory.mktemp("recipe") / "nemo"
    assert main(["recipe", "copy", "nemotron-diffusion-smoke", str(path)]) == 0
    assert main(["data", "prepare", "--config", str(path / "prepare.yaml")]) == 0
    return path


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["objective.block_size=24"], "objective.block_size: 24 does not divide data.seq_len 64"),
        (["objective.ar_weight=-1"], "objective.ar_weight: Input should be greater than or equal to 0"),
        (["objective.diffusion_weight=0", "objective.ar_weight=0"], "both 0: nothing would be trained"),
        (["model.shift_logits=true"], "model.shift_logits: nemotron_diffusion"),
        (["topology.nproc_per_node=2", "topology.context.mode=cp", "topology.context.cp_size=2"],
         "nemotron_diffusion does not support context or block parallelism"),
    ],
)  # fmt: skip
def test_bad_combinations_are_one_line_errors(smoke: Path, capsys, overrides: list[str], says: str):
    from dllm.cli.main import main

    capsys.readouterr()
    sets = [a for o in overrides for a in ("--set", o)]
    assert main(["config", "validate", "--config", str(smoke / "train.yaml"), *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dllm: error: ") and err.count("\n") == 1 and says in err, err


def test_a_drafter_of_this_architecture_is_refused():
    """DFlash drafters copy a plain RoPE: a Ministral 3 target is refused in one line, not drafted wrongly."""
    from types import SimpleNamespace

    from dllm.checkpoint.loading import drafter_config
    from dllm.config.model import ModelConfig
    from dllm.errors import ConfigError

    target = ModelConfig(family="nemotron_labs_diffusion", preset="tiny", vocab_size=V)
    obj = SimpleNamespace(num_layers=1, block_size=8, target_layer_ids=[0], architecture="dllm", target="t")
    with pytest.raises(ConfigError, match="YaRN RoPE or a query temperature"):
        drafter_config(obj, target, mask_id=3)
