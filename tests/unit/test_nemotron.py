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
    "intermediate_size": FF, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "hidden_act": "silu",
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
    cfg = transformers.PretrainedConfig(hidden_size=E, num_attention_heads=H, head_dim=D, max_position_embeddings=256)
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


def test_unsupported_layouts_are_one_line_errors(folder: Path, tmp_path: Path):
    from dllm.errors import ConfigError

    for change in ({"sliding_window": 8}, {"rope_parameters": {**ROPE, "rope_type": "longrope"}}):
        bad = tmp_path / next(iter(change))
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**CONFIG, **change}))
        with pytest.raises(ConfigError):
            model_config_from_hf(bad)
