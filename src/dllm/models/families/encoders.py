"""Bidirectional encoders with an MLM head: BERT (post-LN, learned positions) and ModernBERT (pre-LN, RoPE).

BERT's token-type embedding is folded into the positions (every token has type 0); ModernBERT's fused
Wqkv and Wi are split into pseudo keys so that its rename table stays 1:1, as GPT-2's c_attn is.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError
from dllm.models.families.base import Family, StateDict

# -- BERT (post-LN encoder with an MLM head; token type 0 folded into the positions) -------------------
_BERT_RENAMES = (
    (r"embed_tokens\.weight", "bert.embeddings.word_embeddings.weight"),
    (r"embed_positions\.weight", "bert.embeddings.position_embeddings.weight"),
    (r"embed_norm\.(weight|bias)", "bert.embeddings.LayerNorm.{}"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "bert.encoder.layer.{}.attention.self.query.{}"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "bert.encoder.layer.{}.attention.self.key.{}"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "bert.encoder.layer.{}.attention.self.value.{}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "bert.encoder.layer.{}.attention.output.dense.{}"),
    (r"layers\.(\d+)\.input_layernorm\.(weight|bias)", "bert.encoder.layer.{}.attention.output.LayerNorm.{}"),
    (r"layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", "bert.encoder.layer.{}.intermediate.dense.{}"),
    (r"layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", "bert.encoder.layer.{}.output.dense.{}"),
    (r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", "bert.encoder.layer.{}.output.LayerNorm.{}"),
    (r"head_transform\.dense\.(weight|bias)", "cls.predictions.transform.dense.{}"),
    (r"head_transform\.norm\.(weight|bias)", "cls.predictions.transform.LayerNorm.{}"),
    (r"head_bias", "cls.predictions.bias"),
    (r"lm_head\.weight", "cls.predictions.decoder.weight"),
)
_TOKEN_TYPE = "bert.embeddings.token_type_embeddings.weight"
_POSITIONS = "bert.embeddings.position_embeddings.weight"


def _bert_from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """Every token has type 0, so its type embedding is a constant added to each position row."""
    if _TOKEN_TYPE in sd:
        sd[_POSITIONS] = sd[_POSITIONS] + sd.pop(_TOKEN_TYPE)[0]
    sd.pop("cls.predictions.decoder.bias", None)  # the same tensor as cls.predictions.bias
    if cfg.tie_embeddings:
        sd.pop("cls.predictions.decoder.weight", None)
    return sd


def _bert_to_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    sd[_TOKEN_TYPE] = torch.zeros(2, cfg.hidden_size, dtype=sd[_POSITIONS].dtype)
    sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"].clone()  # safetensors stores no aliases
    return sd


def _bert_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConfigError("model.init_from: only absolute BERT position embeddings are supported")
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"], "intermediate_size": hf["intermediate_size"],
        "max_seq_len": hf.get("max_position_embeddings", 512), "norm_eps": hf.get("layer_norm_eps", 1e-12),
        "activation": {"gelu": "gelu", "gelu_new": "gelu_tanh"}[hf.get("hidden_act", "gelu")],
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }  # fmt: skip


def _bert_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.mlp_size,
        "max_position_embeddings": cfg.max_seq_len, "layer_norm_eps": cfg.norm_eps, "type_vocab_size": 2,
        "hidden_act": "gelu" if cfg.activation == "gelu" else "gelu_new", "tie_word_embeddings": cfg.tie_embeddings,
        "position_embedding_type": "absolute",
    }  # fmt: skip


BERT = Family(
    "bert", ("bert",), "BertForMaskedLM", False, _bert_config_from_hf, _bert_config_to_hf, _BERT_RENAMES,
    from_hf_extra=_bert_from_hf, to_hf_extra=_bert_to_hf, ignore_hf=(r"bert\.pooler\..*",),
)  # fmt: skip


# -- ModernBERT (pre-LN encoder, RoPE, global/local attention layers, GeGLU, MLM head) ----------------
# Wqkv and Wi are fused on disk; they are split into pseudo keys (`attn.Wqkv.{q,k,v}`,
# `mlp.Wi.{gate,up}`) so that the rename table stays 1:1, as for GPT-2's c_attn.
_MODERNBERT_RENAMES = (
    (r"embed_tokens\.weight", "model.embeddings.tok_embeddings.weight"),
    (r"embed_norm\.(weight|bias)", "model.embeddings.norm.{}"),
    (r"layers\.(\d+)\.input_layernorm\.(weight|bias)", "model.layers.{}.attn_norm.{}"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "model.layers.{}.attn.Wqkv.q.{}"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "model.layers.{}.attn.Wqkv.k.{}"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "model.layers.{}.attn.Wqkv.v.{}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "model.layers.{}.attn.Wo.{}"),
    (r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", "model.layers.{}.mlp_norm.{}"),
    (r"layers\.(\d+)\.mlp\.gate_proj\.(weight|bias)", "model.layers.{}.mlp.Wi.gate.{}"),
    (r"layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", "model.layers.{}.mlp.Wi.up.{}"),
    (r"layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", "model.layers.{}.mlp.Wo.{}"),
    (r"norm\.(weight|bias)", "model.final_norm.{}"),
    (r"head_transform\.dense\.(weight|bias)", "head.dense.{}"),
    (r"head_transform\.norm\.(weight|bias)", "head.norm.{}"),
    (r"head_bias", "decoder.bias"),
    (r"lm_head\.weight", "decoder.weight"),
)
# fused on disk -> the pseudo keys it is split into (first part first: Wi's first half is the activated one)
_MODERNBERT_FUSED = {r"attn\.Wqkv": ("q", "k", "v"), r"mlp\.Wi": ("gate", "up")}


def _modernbert_from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        for fused, parts in _MODERNBERT_FUSED.items():
            m = re.fullmatch(rf"(model\.layers\.\d+\.{fused})\.(weight|bias)", k)
            if m:
                for part, chunk in zip(parts, v.chunk(len(parts), dim=0), strict=True):
                    out[f"{m.group(1)}.{part}.{m.group(2)}"] = chunk.contiguous()
                break
        else:
            out[k] = v
    if "decoder.bias" not in out:  # decoder_bias: false is a zero bias
        out["decoder.bias"] = torch.zeros(out["model.embeddings.tok_embeddings.weight"].shape[0])
    return _drop_tied_decoder(out, cfg)


def _drop_tied_decoder(sd: StateDict, cfg: ModelConfig) -> StateDict:
    if cfg.tie_embeddings:
        sd.pop("decoder.weight", None)
    return sd


def _modernbert_to_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        for fused, parts in _MODERNBERT_FUSED.items():
            m = re.fullmatch(rf"(model\.layers\.\d+\.{fused})\.(\w+)\.(weight|bias)", k)
            if m:
                if m.group(2) == parts[0]:
                    out[f"{m.group(1)}.{m.group(3)}"] = torch.cat([sd[f"{m.group(1)}.{p}.{m.group(3)}"] for p in parts])
                break
        else:
            out[k] = v
    return out


_MODERNBERT_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}


def _modernbert_rope(hf: dict[str, Any], kind: str, legacy_key: str, default: float) -> Any:
    params = (hf.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ConfigError("model.init_from: RoPE scaling is not supported yet; only default RoPE")
    return params.get("rope_theta", hf.get(legacy_key, default))  # checked (a number, not a boolean) by ModelConfig


def _modernbert_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    n = hf["num_hidden_layers"]
    every = hf.get("global_attn_every_n_layers", 3)
    types = hf.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    act = hf.get("hidden_activation", "gelu")
    if hf.get("classifier_activation", act) != act:
        raise ConfigError("model.init_from: a ModernBERT head activation other than the MLP's is not supported")
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["hidden_size"], "num_layers": n,
        "num_heads": hf["num_attention_heads"], "intermediate_size": hf["intermediate_size"],
        "max_seq_len": hf.get("max_position_embeddings", 8192), "norm_eps": hf.get("norm_eps", 1e-5),
        "norm_bias": bool(hf.get("norm_bias", False)), "activation": _MODERNBERT_ACTIVATIONS[act],
        "qkv_bias": bool(hf.get("attention_bias")), "attn_out_bias": bool(hf.get("attention_bias")),
        "mlp_bias": bool(hf.get("mlp_bias")), "head_dense_bias": bool(hf.get("classifier_bias", False)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        "attention_pattern": [{"full_attention": "global", "sliding_attention": "local"}[t] for t in types],
        "local_window": hf.get("local_attention", 128) // 2 + 1,  # |i - j| <= local_attention / 2
        "rope_theta": _modernbert_rope(hf, "full_attention", "global_rope_theta", 160000.0),
        "local_rope_theta": _modernbert_rope(hf, "sliding_attention", "local_rope_theta", 10000.0),
    }  # fmt: skip


def _modernbert_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.qkv_bias != cfg.attn_out_bias or cfg.head != "mlm" or cfg.head_dim not in (None, cfg.dim_per_head):
        raise ConfigError("--to-hf: this model's layout has no ModernBERT equivalent (mixed attention biases)")
    act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "silu": "silu"}[cfg.activation]
    window = cfg.local_window or 1
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.mlp_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads, "hidden_activation": act,
        "classifier_activation": act, "max_position_embeddings": cfg.max_seq_len, "norm_eps": cfg.norm_eps,
        "norm_bias": cfg.norm_bias, "attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias,
        "classifier_bias": cfg.head_dense_bias, "decoder_bias": True, "tie_word_embeddings": cfg.tie_embeddings,
        "layer_types": ["sliding_attention" if cfg.layer_is_local(i) else "full_attention"
                        for i in range(cfg.num_layers)],
        "local_attention": 2 * (window - 1),
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta or cfg.rope_theta},
        },
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None, "cls_token_id": None, "sep_token_id": None,
    }  # fmt: skip


MODERNBERT = Family(
    "modernbert", ("modernbert",), "ModernBertForMaskedLM", False, _modernbert_config_from_hf,
    _modernbert_config_to_hf, _MODERNBERT_RENAMES, from_hf_extra=_modernbert_from_hf, to_hf_extra=_modernbert_to_hf,
)  # fmt: skip
