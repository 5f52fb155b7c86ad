"""Families with LLaMA's weight names: llama, qwen2, qwen3, dream, and the MoE stacks qwen3_moe, olmoe, llada_moe.

They share one rename table; only their config.json keys differ, and the MoE layouts list their experts
one by one on disk (`experts.{j}.gate_proj.weight`), fused here into the native [X, 2I, E] / [X, E, I]
tensors and split again on export.

Shapes: X experts, I expert width, E hidden width.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import ConfigMap, Family, StateDict, drop_tied_head

# -- llama-style layouts (llama, qwen2, qwen3, qwen3_moe, dream) -----------------------------------
_LLAMA_RENAMES = (
    (r"embed_tokens\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.(.+)", "model.layers.{}.{}"),
)


def _rope_theta(hf: dict[str, Any]) -> Any:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(f"model.init_from: RoPE scaling {kind!r} is not supported yet; only default RoPE")
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))  # checked (a number, not a boolean) by ModelConfig


def _llama_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim"),
        "intermediate_size": hf["intermediate_size"],
        "max_seq_len": hf.get("max_position_embeddings", 2048),
        "rope_theta": _rope_theta(hf),
        "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "activation": {"silu": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}[hf.get("hidden_act", "silu")],
    }
    if hf.get("attention_bias"):
        out.update(qkv_bias=True, attn_out_bias=True)
    if hf.get("mlp_bias"):
        out["mlp_bias"] = True
    return out


def _llama_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_per_head,
        "intermediate_size": cfg.mlp_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh"}[cfg.activation],
        "attention_bias": cfg.qkv_bias and cfg.attn_out_bias,
        "mlp_bias": cfg.mlp_bias,
    }


def _qwen2_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {**_llama_config_from_hf(hf), "qkv_bias": True, "attn_out_bias": False}


def _qwen3_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    out = _llama_config_from_hf(hf)
    out.update(qk_norm=True, qkv_bias=bool(hf.get("attention_bias")), attn_out_bias=bool(hf.get("attention_bias")))
    return out


def _qwen3_moe_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError("model.init_from: MoE models with dense layers in between are not supported yet")
    return {
        **_qwen3_config_from_hf(hf),
        "num_experts": hf.get("num_experts") or hf["num_local_experts"],  # transformers 5 writes the latter
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }


def _softmax_routing_only(cfg: ModelConfig) -> None:
    """These layouts route by softmax -> top-k over all experts in every layer, without shared experts."""
    if (cfg.router_score, cfg.router_expert_bias, cfg.router_groups, cfg.routed_scaling_factor,
            cfg.num_shared_experts, cfg.first_dense_layers) != ("softmax", False, 1, 1.0, 0, 0):  # fmt: skip
        raise ConfigError(f"--to-hf: this model's MoE routing (sigmoid scores, expert bias or groups, scaling, shared "
                          f"experts or dense layers) has no {cfg.family} equivalent; llada2_moe has them")  # fmt: skip


def _qwen3_moe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    _softmax_routing_only(cfg)
    return {
        **_llama_config_to_hf(cfg),
        "num_experts": cfg.num_experts,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.expert_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _fuse_experts(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """Checkpoints on disk list experts one by one (`experts.{j}.gate_proj.weight`); the native model
    (like transformers 5 in memory) holds them as [X, 2I, E] gate_up and [X, E, I] down tensors."""
    sd = drop_tied_head(sd, cfg)
    per_layer: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
    for k in [k for k in sd if _EXPERT.fullmatch(k)]:
        prefix, j, proj = _EXPERT.fullmatch(k).groups()  # type: ignore[union-attr]
        per_layer.setdefault(prefix, {})[(int(j), proj)] = sd.pop(k)
    for prefix, parts in per_layer.items():
        n = 1 + max(j for j, _ in parts)
        sd[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(j, "gate_proj")], parts[(j, "up_proj")]], dim=0) for j in range(n)]
        )
        sd[f"{prefix}.down_proj"] = torch.stack([parts[(j, "down_proj")] for j in range(n)])
    return sd


def _split_experts(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            for j, t in enumerate(v):
                gate, up = t.chunk(2, dim=0)
                out[f"{k.removesuffix('gate_up_proj')}{j}.gate_proj.weight"] = gate.clone()
                out[f"{k.removesuffix('gate_up_proj')}{j}.up_proj.weight"] = up.clone()
        elif k.endswith("mlp.experts.down_proj"):
            for j, t in enumerate(v):
                out[f"{k.removesuffix('down_proj')}{j}.down_proj.weight"] = t.clone()
        else:
            out[k] = v
    return out


def _llama_like(
    name: str, model_types: tuple[str, ...], architecture: str, config_from_hf: ConfigMap, causal_lm: bool = True
) -> Family:
    """A family with LLaMA's weight names (llama, qwen2, qwen3, dream): only the config keys differ."""
    return Family(
        name, model_types, architecture, causal_lm, config_from_hf, _llama_config_to_hf, _LLAMA_RENAMES,
        from_hf_extra=drop_tied_head, ignore_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
    )  # fmt: skip


LLAMA = _llama_like("llama", ("llama",), "LlamaForCausalLM", _llama_config_from_hf)
QWEN2 = _llama_like("qwen2", ("qwen2",), "Qwen2ForCausalLM", _qwen2_config_from_hf)
QWEN3 = _llama_like("qwen3", ("qwen3",), "Qwen3ForCausalLM", _qwen3_config_from_hf)
DREAM = _llama_like("dream", ("Dream", "dream"), "DreamModel", _qwen2_config_from_hf, causal_lm=False)
QWEN3_MOE = Family(
    "qwen3_moe", ("qwen3_moe",), "Qwen3MoeForCausalLM", True, _qwen3_moe_config_from_hf, _qwen3_moe_config_to_hf,
    _LLAMA_RENAMES, from_hf_extra=_fuse_experts, to_hf_extra=_split_experts,
)  # fmt: skip


# -- OLMoE and LLaDA-MoE (LLaMA names, a router `mlp.gate` and experts `mlp.experts.{j}.*`) --------------
def _moe_routing(hf: dict[str, Any], where: str) -> None:
    """Refuse the routing variants the native MoE does not compute (it is softmax -> top-k, optionally
    renormalised; every layer routed; no shared expert, expert bias, groups or scaling)."""
    shared = hf.get("shared_expert_intermediate_size")
    unsupported = [
        ("moe_router_score_function", hf.get("moe_router_score_function") not in (None, "softmax")),
        ("moe_router_enable_expert_bias", bool(hf.get("moe_router_enable_expert_bias"))),
        ("routed_scaling_factor", hf.get("routed_scaling_factor") not in (None, 1, 1.0)),
        ("shared_expert_intermediate_size", isinstance(shared, int) and shared > 0),
        ("router_num_group", isinstance(hf.get("router_num_group"), int) and hf["router_num_group"] > 1),
        ("moe_layer_freq", any(f != 1 for f in hf.get("moe_layer_freq") or [])),
        ("partial_rotary_factor", hf.get("partial_rotary_factor") not in (None, 1, 1.0, -1)),
        ("clip_qkv", hf.get("clip_qkv") is not None),
    ]
    for key, bad in unsupported:
        if bad:
            raise ConfigError(f"model.init_from: {where} with {key}={hf.get(key)!r} is not supported yet")


def _moe_common_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"], "num_kv_heads": hf.get("num_key_value_heads") or None,
        "head_dim": hf.get("head_dim"), "max_seq_len": hf.get("max_position_embeddings", 4096),
        "rope_theta": _rope_theta(hf), "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": bool(hf.get("attention_bias")), "attn_out_bias": bool(hf.get("attention_bias")),
        "num_experts": hf["num_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
        "norm_topk_prob": bool(hf.get("norm_topk_prob") or False),  # null in LLaDA-MoE: raw top-k probabilities
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.01),
        "activation": {"silu": "silu"}[hf.get("hidden_act", "silu")],
    }  # fmt: skip


def _moe_common_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    _softmax_routing_only(cfg)
    if cfg.qkv_bias != cfg.attn_out_bias or cfg.mlp_bias or cfg.activation != "silu":
        raise ConfigError(f"--to-hf: this model's layout has no {cfg.family} equivalent (biases or activation)")
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": cfg.qkv_bias, "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok, "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef, "hidden_act": "silu",
    }  # fmt: skip


def _llada_moe_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """LLaDA-MoE (inclusionAI, remote code upstream): a bidirectional OLMoE-like stack whose q/k norms
    are per head and whose router weights are the raw top-k softmax probabilities (norm_topk_prob null)."""
    _moe_routing(hf, "a LLaDA-MoE model")
    return {
        **_moe_common_from_hf(hf),
        "moe_intermediate_size": hf["expert_intermediate_size"],
        "intermediate_size": hf.get("dense_intermediate_size") if (hf.get("dense_intermediate_size") or 0) > 0
        else hf["expert_intermediate_size"],
        "qk_norm": bool(hf.get("qk_layernorm", True)),
    }  # fmt: skip


def _llada_moe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.qk_norm and cfg.qk_norm_width != "head":
        raise ConfigError("--to-hf: LLaDA-MoE normalises queries and keys per head; this model does not")
    return {
        **_moe_common_to_hf(cfg), "expert_intermediate_size": cfg.expert_size, "dense_intermediate_size": cfg.mlp_size,
        "qk_layernorm": cfg.qk_norm, "moe_layer_freq": [1] * cfg.num_layers, "moe_router_score_function": "softmax",
        "moe_router_enable_expert_bias": False, "routed_scaling_factor": 1, "shared_expert_intermediate_size": None,
        "partial_rotary_factor": 1.0, "clip_qkv": None,
    }  # fmt: skip


def _olmoe_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    _moe_routing(hf, "an OLMoE model")
    return {**_moe_common_from_hf(hf), "intermediate_size": hf["intermediate_size"], "qk_norm": True}


def _olmoe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if not cfg.qk_norm or cfg.qk_norm_width != "full":
        raise ConfigError("--to-hf: OLMoE normalises queries and keys over all heads; this model does not")
    return {**_moe_common_to_hf(cfg), "intermediate_size": cfg.expert_size, "clip_qkv": None}


# checkpoints on disk list experts one by one, as qwen3_moe's do; `model_type` of LLaDA-MoE releases is
# "llada" (shared with the dense LLaDA, told apart by `architectures`) or "llada_moe"/"lladamoe"
LLADA_MOE = Family(
    "llada_moe", ("llada_moe", "lladamoe"), "LLaDAMoEModelLM", False, _llada_moe_config_from_hf,
    _llada_moe_config_to_hf, _LLAMA_RENAMES, from_hf_extra=_fuse_experts, to_hf_extra=_split_experts,
    architectures_read=("LLaDAMoEModelLM", "LLaDAMoEModel"),
)  # fmt: skip
OLMOE = Family(
    "olmoe", ("olmoe",), "OlmoeForCausalLM", True, _olmoe_config_from_hf, _olmoe_config_to_hf, _LLAMA_RENAMES,
    from_hf_extra=_fuse_experts, to_hf_extra=_split_experts,
)  # fmt: skip
