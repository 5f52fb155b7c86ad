"""LLaDA2.0 / 2.1 (`llada2_moe`, remote code upstream; transformers has no class for it): a random
checkpoint in the public layout (fused query_key_value, attention.dense, query/key_layernorm, a sigmoid
router with `gate.expert_bias`, expert groups, a shared expert, dense first layers) is imported and its
logits compared with a reference forward written below from the math of the public modeling file
(modeling_llada2_moe.py): RMSNorm in float32, partial rotate-half RoPE on the first
partial_rotary_factor of each head, sigmoid scores + bias choose top-2-sum groups then experts,
weights are the unbiased scores renormalised and scaled by routed_scaling_factor. It never touches
dllm's model code. Import then export gives back the same tensors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, import_hf, model_config_from_hf

V, L = 96, 12


def hf_config(**over) -> dict:
    cfg = dict(
        model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"], vocab_size=V, hidden_size=32,
        intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, partial_rotary_factor=0.5, rope_theta=600000.0, rms_norm_eps=1e-6,
        use_qkv_bias=False, use_bias=False, use_qk_norm=True, num_experts=8, num_shared_experts=1,
        num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        max_position_embeddings=64, tie_word_embeddings=False, hidden_act="silu", rope_scaling=None,
    )  # fmt: skip
    cfg.update(over)
    return cfg


def random_weights(c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict in the public key names, every weight random (norms around 1, biases nonzero)."""
    g = torch.Generator().manual_seed(seed)
    E, H, K, D = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def w(*shape, scale=0.2, base=0.0):
        return torch.randn(*shape, generator=g) * scale + base

    def mlp(prefix, inner):
        return {f"{prefix}.gate_proj.weight": w(inner, E), f"{prefix}.up_proj.weight": w(inner, E),
                f"{prefix}.down_proj.weight": w(E, inner)}  # fmt: skip

    sd = {"model.word_embeddings.weight": w(c["vocab_size"], E, scale=1.0), "model.norm.weight": w(E, base=1.0),
          "lm_head.weight": w(c["vocab_size"], E)}  # fmt: skip
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        sd[f"{p}.input_layernorm.weight"] = w(E, base=1.0)
        sd[f"{p}.post_attention_layernorm.weight"] = w(E, base=1.0)
        sd[f"{p}.attention.query_key_value.weight"] = w((H + 2 * K) * D, E)
        if c["use_qkv_bias"]:
            sd[f"{p}.attention.query_key_value.bias"] = w((H + 2 * K) * D)
        sd[f"{p}.attention.dense.weight"] = w(E, H * D)
        if c["use_bias"]:
            sd[f"{p}.attention.dense.bias"] = w(E)
        sd[f"{p}.attention.query_layernorm.weight"] = w(D, base=1.0)
        sd[f"{p}.attention.key_layernorm.weight"] = w(D, base=1.0)
        if i < c["first_k_dense_replace"]:
            sd.update(mlp(f"{p}.mlp", c["intermediate_size"]))
            continue
        sd[f"{p}.mlp.gate.weight"] = w(c["num_experts"], E, scale=0.5)
        sd[f"{p}.mlp.gate.expert_bias"] = w(c["num_experts"], scale=0.1)
        for j in range(c["num_experts"]):
            sd.update(mlp(f"{p}.mlp.experts.{j}", c["moe_intermediate_size"]))
        if c["num_shared_experts"]:
            sd.update(mlp(f"{p}.mlp.shared_experts", c["moe_intermediate_size"] * c["num_shared_experts"]))
    return sd


# -- the reference forward, from the public modeling code's math ------------------------------------------
def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _swiglu(sd, prefix, x):
    return F.linear(F.silu(F.linear(x, sd[f"{prefix}.gate_proj.weight"])) * F.linear(x, sd[f"{prefix}.up_proj.weight"]),
                    sd[f"{prefix}.down_proj.weight"])  # fmt: skip


def _rotate(x, cos, sin):
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = torch.cat((-rot[..., r // 2 :], rot[..., : r // 2]), dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


def _moe(sd, c, p, x):
    N = x.shape[0] * x.shape[1]
    flat = x.reshape(N, -1)
    scores = torch.sigmoid(F.linear(flat.float(), sd[f"{p}.mlp.gate.weight"].float()))
    choose = scores + sd[f"{p}.mlp.gate.expert_bias"]
    G = c["n_group"]
    group = choose.view(N, G, -1).topk(2, dim=-1)[0].sum(-1)
    group_mask = torch.zeros_like(group).scatter_(1, torch.topk(group, c["topk_group"], dim=-1, sorted=False)[1], 1)
    expert_mask = group_mask.unsqueeze(-1).expand(N, G, c["num_experts"] // G).reshape(N, -1)
    idx = torch.topk(choose.masked_fill(~expert_mask.bool(), float("-inf")), c["num_experts_per_tok"], dim=-1)[1]
    wts = torch.gather(scores, 1, idx)
    if c["num_experts_per_tok"] > 1:  # the public gate renormalises only a choice of several
        wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
    wts = wts * c["routed_scaling_factor"]
    out = torch.zeros_like(flat)
    for n in range(N):
        for slot in range(idx.shape[1]):
            out[n] += wts[n, slot] * _swiglu(sd, f"{p}.mlp.experts.{int(idx[n, slot])}", flat[n : n + 1])[0]
    out = out.view_as(x)
    if c["num_shared_experts"]:
        out = out + _swiglu(sd, f"{p}.mlp.shared_experts", x)
    return out


def reference_logits(sd, c, tokens, allowed_LL):
    """The public forward: `allowed_LL[q, k]` says whether query q sees key k."""
    H, K, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    B, T = tokens.shape
    x = sd["model.word_embeddings.weight"][tokens]
    rot = int(D * c["partial_rotary_factor"])
    inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, rot, 2).float() / rot))
    freqs = torch.arange(T).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    bias = torch.zeros(T, T).masked_fill(~allowed_LL, float("-inf"))
    eps = c["rms_norm_eps"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        h = _rms(x, sd[f"{p}.input_layernorm.weight"], eps)
        qkv = F.linear(h, sd[f"{p}.attention.query_key_value.weight"], sd.get(f"{p}.attention.query_key_value.bias"))
        q, k, v = qkv.view(B, T, H + 2 * K, D).split([H, K, K], dim=2)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = _rms(q, sd[f"{p}.attention.query_layernorm.weight"], eps)
        k = _rms(k, sd[f"{p}.attention.key_layernorm.weight"], eps)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        att = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(D) + bias, dim=-1) @ v
        out = F.linear(att.transpose(1, 2).reshape(B, T, H * D), sd[f"{p}.attention.dense.weight"],
                       sd.get(f"{p}.attention.dense.bias"))  # fmt: skip
        x = x + out
        h = _rms(x, sd[f"{p}.post_attention_layernorm.weight"], eps)
        x = x + (_swiglu(sd, f"{p}.mlp", h) if i < c["first_k_dense_replace"] else _moe(sd, c, p, h))
    return F.linear(_rms(x, sd["model.norm.weight"], eps), sd["lm_head.weight"])


# -- tests ---------------------------------------------------------------------------------------------
def write_folder(folder: Path, c: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    sd = random_weights(c, seed)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(c))
    return sd


def load(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder)
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


VARIANTS = {
    "mini-like": {},
    "biases, no shared expert, one group": dict(
        use_qkv_bias=True, use_bias=True, num_shared_experts=0, n_group=1, topk_group=1, first_k_dense_replace=0
    ),  # fmt: skip
    "full rotary, top-1, MHA": dict(partial_rotary_factor=1.0, num_experts_per_tok=1, num_key_value_heads=4),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_the_reference_forward(variant: str, tmp_path: Path):
    c = hf_config(**VARIANTS[variant])
    sd = write_folder(tmp_path / "hf", c)
    model = load(tmp_path / "hf")
    assert model.cfg.family == "llada2_moe"
    tokens = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(L).expand(2, L)
    block = torch.arange(L) // 4
    masks = {"bidirectional": (AttentionMask("bidirectional"), torch.ones(L, L, dtype=torch.bool)),
             "block": (AttentionMask("block_causal", block_size=4), block[:, None] >= block[None, :])}  # fmt: skip
    worst = 0.0
    with torch.no_grad():
        for ours_mask, allowed in masks.values():
            ours, ref = model(tokens, pos, ours_mask).logits(), reference_logits(sd, c, tokens, allowed)
            worst = max(worst, float((ours - ref).abs().max()))
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    print(f"{variant}: max |diff| {worst:.2e}")


def test_import_export_round_trip_is_exact(tmp_path: Path):
    from safetensors.torch import load_file

    c = hf_config(use_qkv_bias=True, use_bias=True)
    sd = write_folder(tmp_path / "hf", c)
    model = load(tmp_path / "hf")
    export_hf(model.state_dict(), model.cfg, tmp_path / "out")
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(back) == set(sd)
    for k, v in sd.items():
        assert torch.equal(back[k], v), k
    again = json.loads((tmp_path / "out" / "config.json").read_text())
    assert again["model_type"] == "llada2_moe" and again["n_group"] == 4 and again["first_k_dense_replace"] == 1
    assert model_config_from_hf(tmp_path / "out") == model_config_from_hf(tmp_path / "hf")


def test_llada21_checkpoints_read_as_the_same_family(tmp_path: Path):
    write_folder(tmp_path / "hf", hf_config(model_type="llada21_moe", num_key_value_heads=4))
    (tmp_path / "hf" / "config.json").write_text(json.dumps(hf_config(model_type="llada21_moe", num_key_value_heads=0)))
    model = load(tmp_path / "hf")
    assert model.cfg.family == "llada2_moe" and model.cfg.kv_heads == 4


def test_native_model_trains_and_inits(tmp_path: Path):
    cfg = ModelConfig(family="llada2_moe", preset="tiny", vocab_size=V, num_experts=4, router_groups=2,
                      router_topk_groups=1, first_dense_layers=1)  # fmt: skip
    model = Transformer(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    assert float(model.layers[1].mlp.expert_bias.abs().sum()) == 0
    out = model(torch.randint(0, V, (1, 8)), torch.arange(8)[None])
    assert set(out.aux) == {"router_loss"}
    out.logits().sum().backward()


@pytest.mark.parametrize(
    "bad, match",
    [(dict(router_groups=3), "router_groups"), (dict(router_topk_groups=8, router_groups=4), "router_groups"),
     (dict(num_experts_per_tok=3, router_groups=4, router_topk_groups=1), "num_experts_per_tok")],
)  # fmt: skip
def test_bad_routing_settings_are_refused(bad: dict, match: str):
    with pytest.raises(ValueError, match=match):
        ModelConfig(family="llada2_moe", preset="tiny", num_experts=8, **bad)


def test_rope_scaling_is_refused(tmp_path: Path):
    write_folder(tmp_path / "hf", hf_config(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ConfigError, match="RoPE scaling"):
        model_config_from_hf(tmp_path / "hf")


def test_adapter_names_follow_the_public_layout():
    """A LoRA adapter file names HF modules: the output projection is attention.dense; q, k and v are fused on
    disk, so an adapter-only export of them is refused (export merged weights)."""
    from dllm.config.registries import FAMILIES
    from dllm.models.families.base import module_path_to_hf

    family, cfg = FAMILIES.resolve("llada2_moe"), ModelConfig(family="llada2_moe", preset="tiny")
    assert module_path_to_hf(family, "layers.1.self_attn.o_proj", cfg) == "model.layers.1.attention.dense"
    assert module_path_to_hf(family, "layers.0.mlp.gate_proj", cfg) == "model.layers.0.mlp.gate_proj"
    with pytest.raises(ConfigError, match="fuses q, k, v"):
        module_path_to_hf(family, "layers.0.self_attn.q_proj", cfg)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "llada_moe"])
def test_softmax_moe_layouts_refuse_llada2_routing_on_export(family: str, tmp_path: Path):
    cfg = ModelConfig(family=family, preset="tiny", vocab_size=V, num_experts=4, router_score="sigmoid")
    model = Transformer(cfg)
    with pytest.raises(ConfigError, match="no .* equivalent; llada2_moe has them"):
        export_hf(model.state_dict(), cfg, tmp_path / "out")
