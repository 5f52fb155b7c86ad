"""MoE checkpoints with OLMoE names (`mlp.gate` router, `mlp.experts.{j}.{gate,up,down}_proj`): OLMoE against
transformers' OlmoeForCausalLM (causal and is_causal=False), and LLaDA-MoE (remote code upstream, never run
here) against a reference forward written below from its description: bidirectional, q/k RMSNorm per
head, router softmax -> top-k with the raw probabilities as weights. Both export back to the same tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dllm.attention.masks import AttentionMask
from dllm.errors import ConfigError
from dllm.models import Transformer
from dllm.models.hf_io import export_hf, family_of, import_hf, model_config_from_hf

V, L, E, H, K, D, X, TOP, INNER = 96, 12, 32, 4, 2, 8, 4, 2, 16


def _import(folder: Path) -> Transformer:
    cfg = model_config_from_hf(folder)
    model = Transformer(cfg)
    model.load_state_dict(import_hf(folder, cfg), strict=True)
    return model.eval()


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, V, (2, L), generator=torch.Generator().manual_seed(1))
    return x, torch.arange(L).expand(2, L)


def _load(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# -- OLMoE: transformers has the class -----------------------------------------------------------------
@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_olmoe_matches_transformers(norm_topk_prob: bool, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.OlmoeConfig(
        vocab_size=V, hidden_size=E, intermediate_size=INNER, num_hidden_layers=2, num_attention_heads=H,
        num_key_value_heads=K, num_experts=X, num_experts_per_tok=TOP, max_position_embeddings=64,
        norm_topk_prob=norm_topk_prob, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.OlmoeForCausalLM(cfg)
    with torch.no_grad():  # norms start at 1 and the router at 0: make every weight matter
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    hf.eval().save_pretrained(tmp_path / "hf")
    ours = _import(tmp_path / "hf")
    assert ours.cfg.family == "olmoe" and ours.cfg.qk_norm_width == "full"
    assert ours.cfg.norm_topk_prob == norm_topk_prob
    x, pos = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(ours(x, pos, AttentionMask("causal")).logits(), hf(x).logits, atol=1e-4, rtol=0)
        bidir = hf(x, attention_mask=torch.ones_like(x), is_causal=False).logits
        torch.testing.assert_close(ours(x, pos, AttentionMask("bidirectional")).logits(), bidir, atol=1e-4, rtol=0)
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    original, exported = _load(tmp_path / "hf" / "model.safetensors"), _load(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys() and all(torch.equal(v, exported[k]) for k, v in original.items())
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, hf(x).logits, atol=1e-5, rtol=0)


# -- LLaDA-MoE: a checkpoint written here, and the reference forward it should compute ------------------
def _llada_moe_config(**extra) -> dict:
    return {
        "model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "vocab_size": V, "hidden_size": E,
        "num_hidden_layers": 2, "num_attention_heads": H, "num_key_value_heads": K, "dense_intermediate_size": 64,
        "expert_intermediate_size": INNER, "shared_expert_intermediate_size": None, "num_experts": X,
        "num_experts_per_tok": TOP, "norm_topk_prob": None, "qk_layernorm": True, "moe_layer_freq": [1, 1],
        "moe_router_score_function": "softmax", "moe_router_enable_expert_bias": False, "routed_scaling_factor": 1,
        "rope_theta": 50000.0, "rope_scaling": None, "partial_rotary_factor": 1.0, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 64, "tie_word_embeddings": False, "attention_bias": False, "clip_qkv": None,
        "hidden_act": "silu", "router_aux_loss_coef": 0.01, **extra,
    }  # fmt: skip


def _llada_moe_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def w(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return mean + torch.randn(*shape, generator=g) * 0.2

    sd = {"model.embed_tokens.weight": w(V, E), "model.norm.weight": w(E, mean=1), "lm_head.weight": w(V, E)}
    for i in range(2):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": w(E, mean=1), p + "post_attention_layernorm.weight": w(E, mean=1),
               p + "self_attn.q_proj.weight": w(H * D, E), p + "self_attn.k_proj.weight": w(K * D, E),
               p + "self_attn.v_proj.weight": w(K * D, E), p + "self_attn.o_proj.weight": w(E, H * D),
               p + "self_attn.q_norm.weight": w(D, mean=1), p + "self_attn.k_norm.weight": w(D, mean=1),
               p + "mlp.gate.weight": w(X, E)}  # fmt: skip
        for j in range(X):
            q = f"{p}mlp.experts.{j}."
            sd |= {q + "gate_proj.weight": w(INNER, E), q + "up_proj.weight": w(INNER, E),
                   q + "down_proj.weight": w(E, INNER)}  # fmt: skip
    return sd


def _write_llada_moe(folder: Path, **extra) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(_llada_moe_weights(), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_llada_moe_config(**extra)))
    return folder


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


def _rotate(x_BHLD: torch.Tensor, pos_BL: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, NeoX/LLaMA halves convention: pairs (i, i + D/2) rotate by pos * theta^(-2i/D)."""
    half = x_BHLD.shape[-1] // 2
    angle = pos_BL[:, None, :, None].double() * theta ** (-torch.arange(half).double() / half)
    cos, sin = angle.cos(), angle.sin()
    a, b = x_BHLD[..., :half].double(), x_BHLD[..., half:].double()
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).float()


def _reference(sd: dict[str, torch.Tensor], x_BL: torch.Tensor, valid_BL: torch.Tensor) -> torch.Tensor:
    """LLaDA-MoE's forward as its model card and code describe it: pre-norm blocks, bidirectional attention
    over valid keys, per-head q/k RMSNorm before RoPE, and each token's output the sum over its top-k experts
    of (softmax probability) * SwiGLU expert (the probabilities are not renormalised)."""
    B = x_BL.shape[0]
    pos = torch.arange(L).expand(B, L)
    h = sd["model.embed_tokens.weight"][x_BL]
    for i in range(2):
        p = f"model.layers.{i}."
        a = _rms(h, sd[p + "input_layernorm.weight"])
        q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(B, L, H, D).transpose(1, 2)
        k = (a @ sd[p + "self_attn.k_proj.weight"].T).view(B, L, K, D).transpose(1, 2)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(B, L, K, D).transpose(1, 2)
        q = _rotate(_rms(q, sd[p + "self_attn.q_norm.weight"]), pos, 50000.0)
        k = _rotate(_rms(k, sd[p + "self_attn.k_norm.weight"]), pos, 50000.0)
        k, v = k.repeat_interleave(H // K, dim=1), v.repeat_interleave(H // K, dim=1)
        scores = (q @ k.transpose(-1, -2)) / D**0.5
        scores = scores.masked_fill(~valid_BL[:, None, None, :], float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, H * D)
        h = h + out @ sd[p + "self_attn.o_proj.weight"].T
        m = _rms(h, sd[p + "post_attention_layernorm.weight"])
        probs = (m @ sd[p + "mlp.gate.weight"].T).softmax(-1)
        y = torch.zeros_like(m)
        for b in range(B):
            for t in range(L):
                top_p, top_i = probs[b, t].topk(TOP)
                for prob, j in zip(top_p.tolist(), top_i.tolist(), strict=True):
                    e = f"{p}mlp.experts.{j}."
                    inner = F.silu(sd[e + "gate_proj.weight"] @ m[b, t]) * (sd[e + "up_proj.weight"] @ m[b, t])
                    y[b, t] += prob * (sd[e + "down_proj.weight"] @ inner)
        h = h + y
    return _rms(h, sd["model.norm.weight"]) @ sd["lm_head.weight"].T


def test_llada_moe_matches_the_reference_forward(tmp_path: Path):
    folder = _write_llada_moe(tmp_path / "llada_moe")
    assert family_of(json.loads((folder / "config.json").read_text())).name == "llada_moe"  # model_type llada
    ours = _import(folder)
    cfg = ours.cfg
    assert (cfg.family, cfg.qk_norm, cfg.qk_norm_width, cfg.norm_topk_prob) == ("llada_moe", True, "head", False)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_size, cfg.rope_theta) == (X, TOP, INNER, 50000.0)
    x, pos = _tokens()
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, 8:] = False
    sd = _llada_moe_weights()
    with torch.no_grad():
        want = _reference(sd, x, torch.ones_like(valid))
        torch.testing.assert_close(ours(x, pos, AttentionMask("bidirectional")).logits(), want, atol=1e-4, rtol=0)
        got = ours(x, pos, AttentionMask("bidirectional", key_valid_BL=valid)).logits()
        torch.testing.assert_close(got[valid], _reference(sd, x, valid)[valid], atol=1e-4, rtol=0)
        # the reference is sharp enough to tell: causal attention or renormalised routing give other logits
        assert not torch.allclose(ours(x, pos, AttentionMask("causal")).logits(), want, atol=1e-2)
        renorm = Transformer(cfg.model_copy(update={"norm_topk_prob": True}))
        renorm.load_state_dict(ours.state_dict())
        assert not torch.allclose(renorm.eval()(x, pos).logits(), want, atol=1e-2)


def test_llada_moe_export_round_trip(tmp_path: Path):
    folder = _write_llada_moe(tmp_path / "in")
    ours = _import(folder)
    export_hf(ours.state_dict(), ours.cfg, tmp_path / "out")
    original, exported = _load(folder / "model.safetensors"), _load(tmp_path / "out" / "model.safetensors")
    assert original.keys() == exported.keys()
    for k, v in original.items():
        assert torch.equal(v, exported[k]), k
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == ["LLaDAMoEModelLM"] and written["expert_intermediate_size"] == INNER
    assert written["norm_topk_prob"] is False and written["qk_layernorm"] is True
    again = _import(tmp_path / "out")
    x, pos = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(again(x, pos).logits(), ours(x, pos).logits(), atol=0, rtol=0)


def test_dense_llada_keeps_its_family():
    assert family_of({"model_type": "llada", "architectures": ["LLaDAModelLM"]}).name == "llada"
    assert family_of({"model_type": "llada_moe"}).name == "llada_moe"


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
     ({"shared_expert_intermediate_size": 32}, "shared_expert_intermediate_size"),
     ({"moe_layer_freq": [0, 1]}, "moe_layer_freq"),
     ({"moe_router_enable_expert_bias": True}, "moe_router_enable_expert_bias")],
)  # fmt: skip
def test_llada_moe_routing_variants_are_refused_by_name(extra: dict, named: str, tmp_path: Path):
    folder = _write_llada_moe(tmp_path / "m", **extra)
    with pytest.raises(ConfigError, match=rf"LLaDA-MoE model with {named}=.* is not supported"):
        model_config_from_hf(folder)
