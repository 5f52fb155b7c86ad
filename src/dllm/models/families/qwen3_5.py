"""Qwen3.5 (dense text): a hybrid of Gated DeltaNet linear-attention layers and gated full attention.

config.json `layer_types` (linear_attention / full_attention) becomes `attention_pattern` (linear /
global); full attention has an output gate (q_proj twice wide), q/k norms and partial RoPE; every
RMSNorm but the linear layers' gated one is zero-centred (scale 1 + w, the `rmsnorm_centered` norm, so
the weights load unchanged). Weight names are LLaMA's plus `linear_attn.*`, 1:1 with the native ones.

Folders of the multimodal release (model_type qwen3_5: `text_config`, weights under
`model.language_model.`) are read for their text model; the vision tower and the multi-token-prediction
head are left out. Export writes the text model (qwen3_5_text, Qwen3_5ForCausalLM).

Qwen3.5-MoE (qwen3_5_moe_text, and the multimodal qwen3_5_moe read the same way): the same hybrid with
every MLP replaced by a mixture of experts (models/moe.py): softmax over the experts, top-k, renormalised,
and one shared expert whose output a per-token sigmoid gate scales (`mlp.shared_expert_gate`). The experts
are listed one by one on disk (`mlp.experts.{j}.gate_proj.weight`, as transformers saves them), fused here
into [X, 2I, E] / [X, E, I] and split again on export; the shared expert is `mlp.shared_expert` there.
"""

from __future__ import annotations

from typing import Any

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import Family, StateDict, drop_tied_head
from dllm.models.families.llama import _LLAMA_RENAMES, _fuse_experts, _split_experts

_KINDS = {"linear_attention": "linear", "full_attention": "global"}


def _rope(hf: dict[str, Any]) -> tuple[Any, Any]:
    """(rope_theta, partial_rotary_factor); text positions are equal on the three M-RoPE axes, so the
    M-RoPE sections reduce to plain RoPE."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(f"model.init_from: RoPE scaling {kind!r} is not supported yet; only default RoPE")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000000.0))
    return theta, params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))


def _config_from_hf(top: dict[str, Any]) -> dict[str, Any]:
    hf = top.get("text_config") or top
    theta, fraction = _rope(hf)
    n = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval", 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                      for i in range(n)]  # fmt: skip
    bias = bool(hf.get("attention_bias"))
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": n,
        "num_heads": hf["num_attention_heads"], "num_kv_heads": hf.get("num_key_value_heads"),
        "head_dim": hf.get("head_dim", 256), "intermediate_size": hf.get("intermediate_size"),
        "max_seq_len": hf.get("max_position_embeddings", 32768), "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": theta, "rotary_fraction": fraction, "attention_pattern": [_KINDS[t] for t in types],
        "tie_embeddings": bool(top.get("tie_word_embeddings", hf.get("tie_word_embeddings", False))),
        "activation": {"silu": "silu"}[hf.get("hidden_act", "silu")], "qkv_bias": bias, "attn_out_bias": bias,
        "linear_num_key_heads": hf.get("linear_num_key_heads", 16),
        "linear_num_value_heads": hf.get("linear_num_value_heads", 32),
        "linear_key_head_dim": hf.get("linear_key_head_dim", 128),
        "linear_value_head_dim": hf.get("linear_value_head_dim", 128),
        "linear_conv_kernel": hf.get("linear_conv_kernel_dim", 4),
    }  # fmt: skip


def _config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.num_experts:
        raise ConfigError("--to-hf: a Qwen3.5 model with experts is family qwen3_5_moe")
    return {**_hybrid_to_hf(cfg), "intermediate_size": cfg.mlp_size}


def _hybrid_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The keys of both variants (all but the MLP's)."""
    if (
        cfg.norm != "rmsnorm_centered" or not cfg.qk_norm or cfg.qk_norm_width != "head" or not cfg.attn_output_gate
        or cfg.qkv_bias != cfg.attn_out_bias or cfg.mlp_bias or cfg.activation != "silu"
        or any(cfg.layer_kind(i) == "local" for i, _ in cfg.layer_classes())
    ):  # fmt: skip
        raise ConfigError("--to-hf: this model's layout has no Qwen3.5 equivalent (norms, gates, biases or layers)")
    kinds = {"linear": "linear_attention", "global": "full_attention"}
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.rotary_fraction},
        "layer_types": [kinds[cfg.layer_kind(i)] for i in range(cfg.num_layers)],
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": cfg.qkv_bias,
        "linear_num_key_heads": cfg.linear_key_heads, "linear_num_value_heads": cfg.linear_value_heads,
        "linear_key_head_dim": cfg.linear_key_dim, "linear_value_head_dim": cfg.linear_value_dim,
        "linear_conv_kernel_dim": cfg.linear_conv_kernel,
    }  # fmt: skip


def _text_model(sd: StateDict) -> StateDict:
    """The multimodal layout keeps the text model under model.language_model."""
    prefix = "model.language_model."
    return {("model." + k.removeprefix(prefix) if k.startswith(prefix) else k): v for k, v in sd.items()}


def _from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    return drop_tied_head(_text_model(sd), cfg)


# -- Qwen3.5-MoE: every layer's MLP is routed experts plus one gated shared expert ----------------------
def _moe_config_from_hf(top: dict[str, Any]) -> dict[str, Any]:
    """Softmax over the experts, top-k, always renormalised (the config has no norm_topk_prob); the shared
    expert's width is a whole number of experts' (every release so far: one)."""
    hf = top.get("text_config") or top
    expert, shared = hf.get("moe_intermediate_size", 512), hf.get("shared_expert_intermediate_size", 512)
    if not shared or shared % expert:
        raise ConfigError(f"model.init_from: a Qwen3.5-MoE shared expert of width {shared} that is not a multiple "
                          f"of the experts' {expert} is not supported")  # fmt: skip
    return {
        **_config_from_hf(top), "num_experts": hf.get("num_experts", 256),
        "num_experts_per_tok": hf.get("num_experts_per_tok", 8), "moe_intermediate_size": expert,
        "num_shared_experts": shared // expert, "shared_expert_gate": True, "norm_topk_prob": True,
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }  # fmt: skip


def _moe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    routing = (cfg.router_score, cfg.router_expert_bias, cfg.router_groups, cfg.routed_scaling_factor,
               cfg.first_dense_layers, cfg.moe_layout, cfg.norm_topk_prob)  # fmt: skip
    if routing != ("softmax", False, 1, 1.0, 0, "replace", True) or not (
        cfg.num_shared_experts and cfg.shared_expert_gate
    ):
        raise ConfigError("--to-hf: Qwen3.5-MoE routes every layer by softmax -> top-k, renormalised, with one "
                          "sigmoid-gated shared expert; this model's MoE layout differs")  # fmt: skip
    return {
        **_hybrid_to_hf(cfg), "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.expert_size, "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "shared_expert_intermediate_size": cfg.num_shared_experts * cfg.expert_size,
    }  # fmt: skip


def _moe_from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """The text model (as the dense variant's), its experts fused from their one-by-one names on disk."""
    return _fuse_experts(_text_model(sd), cfg)


# the shared expert is `mlp.shared_expert` on disk, `mlp.shared_experts` (the MoE layer's) here
_MOE_RENAMES = ((r"layers\.(\d+)\.mlp\.shared_experts\.(.+)", "model.layers.{}.mlp.shared_expert.{}"), *_LLAMA_RENAMES)


QWEN3_5 = Family(
    "qwen3_5", ("qwen3_5_text", "qwen3_5"), "Qwen3_5ForCausalLM", True, _config_from_hf, _config_to_hf,
    _LLAMA_RENAMES, from_hf_extra=_from_hf, ignore_hf=(r"model\.visual\..*", r"mtp\..*"),
)  # fmt: skip
QWEN3_5_MOE = Family(
    "qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"), "Qwen3_5MoeForCausalLM", True, _moe_config_from_hf,
    _moe_config_to_hf, _MOE_RENAMES, from_hf_extra=_moe_from_hf, to_hf_extra=_split_experts,
    ignore_hf=(r"model\.visual\..*", r"mtp\..*"),
)  # fmt: skip
