"""LLaDA (GSAI-ML, remote code upstream): its own checkpoint names and OLMo-style config keys.

LLaDA-MoE shares LLaMA's names and lives with the other MoE stacks in llama.py.
"""

from __future__ import annotations

from typing import Any

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import Family

_LLADA_RENAMES = (
    (r"embed_tokens\.weight", "model.transformer.wte.weight"),
    (r"norm\.weight", "model.transformer.ln_f.weight"),
    (r"lm_head\.weight", "model.transformer.ff_out.weight"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "model.transformer.blocks.{}.q_proj.{}"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "model.transformer.blocks.{}.k_proj.{}"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "model.transformer.blocks.{}.v_proj.{}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.weight", "model.transformer.blocks.{}.attn_out.weight"),
    (r"layers\.(\d+)\.input_layernorm\.weight", "model.transformer.blocks.{}.attn_norm.weight"),
    (r"layers\.(\d+)\.post_attention_layernorm\.weight", "model.transformer.blocks.{}.ff_norm.weight"),
    (r"layers\.(\d+)\.mlp\.gate_proj\.weight", "model.transformer.blocks.{}.ff_proj.weight"),
    (r"layers\.(\d+)\.mlp\.up_proj\.weight", "model.transformer.blocks.{}.up_proj.weight"),
    (r"layers\.(\d+)\.mlp\.down_proj\.weight", "model.transformer.blocks.{}.ff_out.weight"),
)


def _llada_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("include_bias"):
        raise ConfigError("model.init_from: LLaDA checkpoints with biases (include_bias) are not supported")
    return {
        "vocab_size": hf.get("embedding_size") or hf["vocab_size"],
        "hidden_size": hf["d_model"],
        "num_layers": hf["n_layers"],
        "num_heads": hf["n_heads"],
        "num_kv_heads": hf.get("n_kv_heads") or hf["n_heads"],
        "intermediate_size": hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * hf["d_model"],
        "max_seq_len": hf.get("max_sequence_length", 4096),
        "rope_theta": hf.get("rope_theta", 10000.0),
        "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "tie_embeddings": bool(hf.get("weight_tying", False)),
        "qkv_bias": bool(hf.get("include_qkv_bias")),
    }


def _llada_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "embedding_size": cfg.vocab_size, "d_model": cfg.hidden_size,
        "n_layers": cfg.num_layers, "n_heads": cfg.num_heads, "n_kv_heads": cfg.kv_heads,
        "mlp_hidden_size": cfg.mlp_size, "max_sequence_length": cfg.max_seq_len, "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps, "weight_tying": cfg.tie_embeddings, "include_qkv_bias": cfg.qkv_bias,
        "include_bias": False, "rope": True, "activation_type": "silu", "block_type": "llama",
        "layer_norm_type": "rms", "alibi": False,
    }  # fmt: skip


LLADA = Family("llada", ("llada",), "LLaDAModelLM", False, _llada_config_from_hf, _llada_config_to_hf, _LLADA_RENAMES)
