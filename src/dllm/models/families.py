"""Families: how each Hugging Face checkpoint layout maps onto the one native Transformer.

A family is data: its config.json keys -> ModelConfig fields, and a weight-name map (with the few
tensor transforms some layouts need: GPT-2's transposed Conv1D and fused qkv, BERT's token-type
embedding, ModernBERT's fused qkv and gate/up). Import and export use the same map in both directions,
so a round trip is exact.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from dllm.config.model import ModelConfig
from dllm.errors import ConfigError

StateDict = dict[str, torch.Tensor]
ConfigMap = Callable[[dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    """config.json `model_type` values read as this family (the first is written on export)."""
    architecture: str
    """config.json `architectures` entry written on export."""
    causal_lm: bool
    """Loadable with transformers' AutoModelForCausalLM (an autoregressive family)."""
    config_from_hf: Callable[[dict[str, Any]], dict[str, Any]]
    config_to_hf: Callable[[ModelConfig], dict[str, Any]]
    renames: tuple[tuple[str, str], ...]
    """(native regex, HF template) pairs, applied in order; `{i}` stands for the layer index."""
    from_hf_extra: Callable[[StateDict, ModelConfig], StateDict] = field(default=lambda sd, cfg: sd)
    to_hf_extra: Callable[[StateDict, ModelConfig], StateDict] = field(default=lambda sd, cfg: sd)
    ignore_hf: tuple[str, ...] = ()
    """HF keys (regex) that carry nothing the native model needs (buffers, unused poolers)."""
    architectures_read: tuple[str, ...] = ()
    """config.json `architectures` entries that pick this family before `model_type` is looked at."""


# -- name maps -----------------------------------------------------------------------------------------
_GROUP = re.compile(r"\(([^()]*)\)")


def _native_to_hf(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    for native, hf in renames:
        m = re.fullmatch(native, name)
        if m:
            return hf.format(*m.groups())
    raise KeyError(name)


def _hf_to_native(name: str, renames: tuple[tuple[str, str], ...]) -> str:
    """The inverse of `_native_to_hf`: each `{}` of the HF template matches the native group's pattern."""
    for native, hf in renames:
        pattern = re.escape(hf)
        for group in _GROUP.findall(native):  # `{}` placeholders in order, each with its group's pattern
            pattern = pattern.replace(r"\{\}", f"({group})", 1)
        m = re.fullmatch(pattern, name)
        if m:
            template = _GROUP.sub("{}", native).replace("\\", "")
            return template.format(*m.groups())
    raise KeyError(name)


def native_to_hf_name(family: Family, name: str) -> str:
    """The Hugging Face name of a native parameter (KeyError when the family has no place for it)."""
    return _native_to_hf(name, family.renames)


def module_path_to_hf(family: Family, path: str) -> str:
    """The Hugging Face module path of a native linear layer (for adapter files)."""
    hf = _native_to_hf(f"{path}.weight", family.renames).removesuffix(".weight")
    if re.search(r"(c_attn|Wqkv)\.[qkv]$|Wi\.(gate|up)$", hf):
        raise ConfigError("--adapter-only: this family fuses q, k, v (or gate, up) in one layer; export merged weights")
    return hf


def state_to_hf(family: Family, native: StateDict, cfg: ModelConfig) -> StateDict:
    out = {_native_to_hf(k, family.renames): v for k, v in native.items()}
    return family.to_hf_extra(out, cfg)


def state_from_hf(family: Family, hf: StateDict, cfg: ModelConfig) -> StateDict:
    hf = family.from_hf_extra(dict(hf), cfg)
    out: StateDict = {}
    for k, v in hf.items():
        if any(re.fullmatch(p, k) for p in family.ignore_hf):
            continue
        try:
            out[_hf_to_native(k, family.renames)] = v
        except KeyError:
            raise ConfigError(f"model.init_from: weight {k!r} has no place in a {family.name} model") from None
    return out


# -- llama-style layouts (llama, qwen2, qwen3, qwen3_moe, dream) -----------------------------------
_LLAMA_RENAMES = (
    (r"embed_tokens\.weight", "model.embed_tokens.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
    (r"layers\.(\d+)\.(.+)", "model.layers.{}.{}"),
)


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(f"model.init_from: RoPE scaling {kind!r} is not supported yet; only default RoPE")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


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
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
    }


def _qwen3_moe_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
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
    sd = _drop_tied_head(sd, cfg)
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


def _drop_tied_head(sd: StateDict, cfg: ModelConfig) -> StateDict:
    """A tied checkpoint may still list lm_head.weight (a copy of the embedding): ignore it."""
    if cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def _llama_like(
    name: str, model_types: tuple[str, ...], architecture: str, config_from_hf: ConfigMap, causal_lm: bool = True
) -> Family:
    """A family with LLaMA's weight names (llama, qwen2, qwen3, dream): only the config keys differ."""
    return Family(
        name, model_types, architecture, causal_lm, config_from_hf, _llama_config_to_hf, _LLAMA_RENAMES,
        from_hf_extra=_drop_tied_head, ignore_hf=(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
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
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.01)),
        "activation": {"silu": "silu"}[hf.get("hidden_act", "silu")],
    }  # fmt: skip


def _moe_common_to_hf(cfg: ModelConfig) -> dict[str, Any]:
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


# -- LLaDA (its own checkpoint names, OLMo-style config keys) -----------------------------------------
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
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
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


# -- GPT-2 (Conv1D weights are [in, out]; q, k, v fused in c_attn) -------------------------------------
# c_attn is split into three pseudo keys `attn.c_attn.{q,k,v}` so that the rename table stays 1:1.
_GPT2_RENAMES = (
    (r"embed_tokens\.weight", "transformer.wte.weight"),
    (r"embed_positions\.weight", "transformer.wpe.weight"),
    (r"norm\.(weight|bias)", "transformer.ln_f.{}"),
    (r"layers\.(\d+)\.input_layernorm\.(weight|bias)", "transformer.h.{}.ln_1.{}"),
    (r"layers\.(\d+)\.post_attention_layernorm\.(weight|bias)", "transformer.h.{}.ln_2.{}"),
    (r"layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "transformer.h.{}.attn.c_attn.q.{}"),
    (r"layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "transformer.h.{}.attn.c_attn.k.{}"),
    (r"layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "transformer.h.{}.attn.c_attn.v.{}"),
    (r"layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "transformer.h.{}.attn.c_proj.{}"),
    (r"layers\.(\d+)\.mlp\.up_proj\.(weight|bias)", "transformer.h.{}.mlp.c_fc.{}"),
    (r"layers\.(\d+)\.mlp\.down_proj\.(weight|bias)", "transformer.h.{}.mlp.c_proj.{}"),
    (r"lm_head\.weight", "lm_head.weight"),
)
_CONV1D = re.compile(r"transformer\.h\.\d+\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight")
_C_ATTN = re.compile(r"(transformer\.h\.\d+\.attn\.c_attn)\.(weight|bias)")


def _gpt2_from_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        if re.search(r"\.attn\.(masked_)?bias$", k):  # causal-mask buffers of old checkpoints
            continue
        k = k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}"  # GPT2Model-only files
        v = v.t().contiguous() if _CONV1D.fullmatch(k) else v
        m = _C_ATTN.fullmatch(k)
        if m:
            for part, chunk in zip("qkv", v.chunk(3, dim=0), strict=True):
                out[f"{m.group(1)}.{part}.{m.group(2)}"] = chunk.contiguous()
        else:
            out[k] = v
    return _drop_tied_head(out, cfg)


def _gpt2_to_hf(sd: StateDict, cfg: ModelConfig) -> StateDict:
    out: StateDict = {}
    for k, v in sd.items():
        m = re.fullmatch(r"(transformer\.h\.\d+\.attn\.c_attn)\.([qkv])\.(weight|bias)", k)
        if m and m.group(2) == "q":
            k = f"{m.group(1)}.{m.group(3)}"
            v = torch.cat([sd[f"{m.group(1)}.{p}.{m.group(3)}"] for p in "qkv"], dim=0)
        elif m:
            continue
        out[k] = v.t().contiguous() if _CONV1D.fullmatch(k) else v
    return out


def _gpt2_config_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("scale_attn_by_inverse_layer_idx") or hf.get("reorder_and_upcast_attn"):
        raise ConfigError("model.init_from: GPT-2 attention variants (scale by layer index) are not supported")
    act = hf.get("activation_function", "gelu_new")
    return {
        "vocab_size": hf["vocab_size"], "hidden_size": hf["n_embd"], "num_layers": hf["n_layer"],
        "num_heads": hf["n_head"], "intermediate_size": hf.get("n_inner") or 4 * hf["n_embd"],
        "max_seq_len": hf.get("n_positions", 1024), "norm_eps": hf.get("layer_norm_epsilon", 1e-5),
        "activation": "gelu" if act == "gelu" else "gelu_tanh",
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }  # fmt: skip


def _gpt2_config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "vocab_size": cfg.vocab_size, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers, "n_head": cfg.num_heads,
        "n_inner": cfg.mlp_size, "n_positions": cfg.max_seq_len, "layer_norm_epsilon": cfg.norm_eps,
        "activation_function": "gelu" if cfg.activation == "gelu" else "gelu_new",
        "tie_word_embeddings": cfg.tie_embeddings,
    }  # fmt: skip


GPT2 = Family(
    "gpt2", ("gpt2",), "GPT2LMHeadModel", True, _gpt2_config_from_hf, _gpt2_config_to_hf, _GPT2_RENAMES,
    from_hf_extra=_gpt2_from_hf, to_hf_extra=_gpt2_to_hf,
)  # fmt: skip


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


def _modernbert_rope(hf: dict[str, Any], kind: str, legacy_key: str, default: float) -> float:
    params = (hf.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise ConfigError("model.init_from: RoPE scaling is not supported yet; only default RoPE")
    return float(params.get("rope_theta", hf.get(legacy_key, default)))


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
