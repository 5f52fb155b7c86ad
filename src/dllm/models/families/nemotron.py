"""Nemotron-Labs-Diffusion (NVIDIA, 3B / 8B / 14B): a Ministral 3 decoder trained as an AR + diffusion model.

The network is Ministral 3's text decoder, a LLaMA-style stack (RMSNorm, GQA, SwiGLU) with YaRN RoPE and
Llama 4's attention temperature on the queries, and an untied output head. The checkpoint (remote code
upstream, `model_type` nemotron_labs_diffusion) keeps the stack under `encoder.` and the head as
`diffusion_head.weight`, which serves both the diffusion and the next-token predictions (the weight
map of NVIDIA's Megatron-Bridge conversion, nemotron_labs_diffusion_bridge.py). The training recipe
is the `nemotron_diffusion` objective (diffusion/objectives/nemotron.py). config.json also says how the
model decodes and trained (mask_token_id, block_size, dlm_paradigm, the loss weights): a folder without a
decode profile decodes by them, and an export writes them from the decode profile and the run's objective.
"""

from __future__ import annotations

from typing import Any

from dllm.config.model import ModelConfig
from dllm.config.objectives import ARConfig, NemotronDiffusionConfig
from dllm.config.profile import DecodeProfile
from dllm.errors import ConfigError
from dllm.models.families.base import Family, StateDict

_RENAMES = (
    (r"embed_tokens\.weight", "encoder.embed_tokens.weight"),
    (r"norm\.weight", "encoder.norm.weight"),
    (r"lm_head\.weight", "diffusion_head.weight"),
    (r"layers\.(\d+)\.(.+)", "encoder.layers.{}.{}"),
)


def _rope_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """rope_parameters -> rope_theta, rope_yarn and the query temperature (Ministral 3's keys)."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ConfigError(f"model.init_from: RoPE scaling {kind!r} is not supported; only default and yarn")
    if params.get("attention_factor") is not None or params.get("truncate") is False:
        raise ConfigError("model.init_from: YaRN with attention_factor or truncate: false is not supported")
    out: dict[str, Any] = {"rope_theta": params.get("rope_theta", hf.get("rope_theta", 10000.0))}
    original = params.get("original_max_position_embeddings")
    if kind == "yarn":
        keys = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        given = {k: params[k] for k in keys if params.get(k) is not None}
        out["rope_yarn"] = {"original_max_seq_len": original, **given}
    if params.get("llama_4_scaling_beta"):
        out.update(query_scale_beta=params["llama_4_scaling_beta"], query_scale_length=original)
    return out


def _config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("sliding_window") is not None:
        raise ConfigError("model.init_from: Nemotron-Labs-Diffusion with a sliding window is not supported")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ConfigError("model.init_from: this Nemotron-Labs-Diffusion layout (biases, activation) is not supported")
    return {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "head_dim": hf.get("head_dim"),
        "intermediate_size": hf["intermediate_size"],
        "max_seq_len": hf.get("max_position_embeddings", 262144),
        "norm_eps": hf.get("rms_norm_eps", 1e-5),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        **_rope_from_hf(hf),
    }


def _config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.qkv_bias or cfg.attn_out_bias or cfg.mlp_bias or cfg.activation != "silu" or cfg.qk_norm:
        raise ConfigError("--to-hf: this model's layout has no nemotron_labs_diffusion equivalent")
    rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_yarn is not None:
        y = cfg.rope_yarn
        rope.update(
            rope_type="yarn", factor=y.factor, original_max_position_embeddings=y.original_max_seq_len,
            beta_fast=y.beta_fast, beta_slow=y.beta_slow, mscale=y.mscale, mscale_all_dim=y.mscale_all_dim,
        )  # fmt: skip
    if cfg.query_scale_beta is not None:
        if rope.get("original_max_position_embeddings", cfg.query_scale_length) != cfg.query_scale_length:
            raise ConfigError("--to-hf: Ministral 3 ties query_scale_length to the YaRN pretraining context")
        rope.update(llama_4_scaling_beta=cfg.query_scale_beta, original_max_position_embeddings=cfg.query_scale_length)
    return {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.dim_per_head,
        "intermediate_size": cfg.mlp_size, "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "sliding_window": None, "rope_parameters": rope,
    }  # fmt: skip


def _count(hf: dict[str, Any], key: str, least: int) -> int:
    value = hf[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{key}: expected an integer of at least {least}, not {value!r}")
    return value


def _decode_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """config.json's decode keys as decode facts: mask_token_id is the mask id; dlm_paradigm autoregressive (the
    reference's plain causal attention) a causal model; any other paradigm with a block_size block decoding in
    blocks of that size with a token-causal context, as the nemotron_diffusion objective trains (the published
    config: bidirectional, block_size 32, mask_token_id 100)."""
    facts: dict[str, Any] = {} if hf.get("mask_token_id") is None else {"mask_id": _count(hf, "mask_token_id", 0)}
    paradigm = hf.get("dlm_paradigm")
    if paradigm is not None and not isinstance(paradigm, str):
        raise ValueError(f"dlm_paradigm: expected a string, not {paradigm!r}")
    if paradigm == "autoregressive":
        return {**facts, **ARConfig().decode_facts()}
    if hf.get("block_size") is not None:
        facts.update(NemotronDiffusionConfig(block_size=_count(hf, "block_size", 1)).decode_facts())
    return facts


def _decode_to_hf(profile: DecodeProfile, objective: Any) -> dict[str, Any]:
    """The published config's decode and loss keys: the mask id; a causal model's paradigm, autoregressive; a
    block model with a token-causal context (nemotron_diffusion's) the published checkpoint's, bidirectional, and
    its block size; a nemotron_diffusion run's loss weights (dlm_loss_weight: the diffusion term's)."""
    out: dict[str, Any] = {"mask_token_id": profile.mask_id}
    if profile.attention == "causal":
        out["dlm_paradigm"] = "autoregressive"
    elif profile.attention == "block" and profile.causal_context:
        out.update(dlm_paradigm="bidirectional", block_size=profile.block_size)
    if isinstance(objective, NemotronDiffusionConfig):
        out.update(dlm_loss_weight=objective.diffusion_weight, ar_loss_weight=objective.ar_weight)
    return out


def _drop_tied_head(sd: StateDict, cfg: ModelConfig) -> StateDict:
    if cfg.tie_embeddings:
        sd.pop("diffusion_head.weight", None)
    return sd


NEMOTRON_LABS_DIFFUSION = Family(
    "nemotron_labs_diffusion", ("nemotron_labs_diffusion",), "NemotronLabsDiffusionModel", False,
    _config_from_hf, _config_to_hf, _RENAMES, from_hf_extra=_drop_tied_head,
    ignore_hf=(r"encoder\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",), decode_from_hf=_decode_from_hf,
    decode_to_hf=_decode_to_hf,
)  # fmt: skip
