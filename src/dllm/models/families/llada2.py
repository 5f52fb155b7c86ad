"""LLaDA2.0 / LLaDA2.1 (inclusionAI, remote code upstream, model_type llada2_moe): Ling-style MoE blocks.

Its checkpoints fuse q, k, v in one `attention.query_key_value` ([q heads; k heads; v heads] rows),
name the output projection `attention.dense` and the per-head q/k norms `query_layernorm` /
`key_layernorm`, and embed with `model.word_embeddings`. The router is `mlp.gate` (sigmoid scores,
its selection bias `mlp.gate.expert_bias`), experts are listed one by one as in llama.py's MoE
layouts, the shared expert is `mlp.shared_experts`, and the first `first_k_dense_replace` layers have
a dense `mlp.{gate,up,down}_proj`. LLaDA2.1 uses the same layout and config keys.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import Family, StateDict
from dllm.models.families.llama import _fuse_experts, _split_experts

_RENAMES = (
    (r"embed_tokens\.weight", "model.word_embeddings.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", "model.layers.{}.attention.{}_proj.{}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "model.layers.{}.attention.dense.{}"),
    (r"layers\.(\d+)\.self_attn\.q_norm\.weight", "model.layers.{}.attention.query_layernorm.weight"),
    (r"layers\.(\d+)\.self_attn\.k_norm\.weight", "model.layers.{}.attention.key_layernorm.weight"),
    (r"layers\.(\d+)\.mlp\.expert_bias", "model.layers.{}.mlp.gate.expert_bias"),
    (r"layers\.(\d+)\.(.+)", "model.layers.{}.{}"),
)
_QKV = re.compile(r"(model\.layers\.\d+\.attention)\.query_key_value\.(weight|bias)")
_SPLIT = re.compile(r"(model\.layers\.\d+\.attention)\.q_proj\.(weight|bias)")


def _config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("rope_scaling") or (hf.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        raise ConfigError("model.init_from: a LLaDA2 model with RoPE scaling is not supported yet; only default RoPE")
    heads = hf["num_attention_heads"]
    experts = hf.get("num_experts") or 0
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
        "num_heads": heads, "num_kv_heads": hf.get("num_key_value_heads") or heads, "head_dim": hf.get("head_dim"),
        "intermediate_size": hf.get("intermediate_size") or hf["moe_intermediate_size"],
        "moe_intermediate_size": hf.get("moe_intermediate_size"),
        "max_seq_len": hf.get("max_position_embeddings", 16384), "rope_theta": hf.get("rope_theta", 10000.0),
        "rotary_fraction": hf.get("partial_rotary_factor", 0.5), "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qk_norm": bool(hf.get("use_qk_norm", True)),
        "qkv_bias": bool(hf.get("use_qkv_bias", False)), "attn_out_bias": bool(hf.get("use_bias", True)),
        "activation": {"silu": "silu"}[hf.get("hidden_act", "silu")], "num_experts": experts,
        "num_experts_per_tok": hf.get("num_experts_per_tok", 2), "norm_topk_prob": True,
        "router_groups": hf.get("n_group") or 1, "router_topk_groups": hf.get("topk_group") or 1,
        "routed_scaling_factor": hf.get("routed_scaling_factor", 2.5),
        "num_shared_experts": hf.get("num_shared_experts") or 0,
        "first_dense_layers": hf.get("first_k_dense_replace", 0) if experts else 0,
    }  # fmt: skip


def _config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.num_experts > 0
    if moe and (cfg.router_score != "sigmoid" or not cfg.router_expert_bias or not cfg.norm_topk_prob):
        raise ConfigError("--to-hf: LLaDA2 routes with sigmoid scores, an expert bias and renormalised weights; "
                          "this model does not")  # fmt: skip
    if cfg.mlp_bias or cfg.activation != "silu" or (cfg.qk_norm and cfg.qk_norm_width != "head"):
        raise ConfigError(
            "--to-hf: this model's layout has no llada2_moe equivalent (MLP biases, activation, q/k norm)"
        )
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
        "intermediate_size": cfg.mlp_size, "moe_intermediate_size": cfg.expert_size,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rope_scaling": None,
        "partial_rotary_factor": cfg.rotary_fraction, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "use_qk_norm": cfg.qk_norm, "use_qkv_bias": cfg.qkv_bias,
        "use_bias": cfg.attn_out_bias, "hidden_act": "silu", "norm_head": False,
        "num_experts": cfg.num_experts if moe else None, "num_experts_per_tok": cfg.num_experts_per_tok,
        "n_group": cfg.router_groups, "topk_group": cfg.router_topk_groups,
        "routed_scaling_factor": cfg.routed_scaling_factor, "num_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.first_dense_layers, "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "use_cache": False,
    }  # fmt: skip


def _from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """Split the fused query_key_value rows into q, k and v; fuse the experts."""
    H, K, D = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
    for key in [k for k in sd if _QKV.fullmatch(k)]:
        prefix, kind = _QKV.fullmatch(key).groups()  # type: ignore[union-attr]
        q, k, v = sd.pop(key).split([H * D, K * D, K * D], dim=0)
        sd.update({f"{prefix}.q_proj.{kind}": q, f"{prefix}.k_proj.{kind}": k, f"{prefix}.v_proj.{kind}": v})
    return _fuse_experts(sd, cfg)


def _to_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    sd = _split_experts(sd, cfg)
    for key in [k for k in sd if _SPLIT.fullmatch(k)]:
        prefix, kind = _SPLIT.fullmatch(key).groups()  # type: ignore[union-attr]
        parts = [sd.pop(f"{prefix}.{p}_proj.{kind}") for p in "qkv"]
        sd[f"{prefix}.query_key_value.{kind}"] = torch.cat(parts, dim=0)
    return sd


LLADA2_MOE = Family(
    "llada2_moe", ("llada2_moe", "llada21_moe"), "LLaDA2MoeModelLM", False, _config_from_hf, _config_to_hf,
    _RENAMES, from_hf_extra=_from_hf, to_hf_extra=_to_hf, block_size=32,  # the public samplers' block_length
)  # fmt: skip
